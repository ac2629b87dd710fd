// Db::Impl's lifecycle: construction and open (start-up rebuild), the Call
// that counts every public call, flush, close, and the exit handler that
// closes every Db still open when the process exits.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "db/grace.h"
#include "db/guarded.h"
#include "db/impl.h"
#include "db/state_rebuild.h"
#include "storage/format.h"
#include "storage/index.h"
#include "storage/sealed_ledger.h"
#include "storage/secret.h"

namespace tidal {
namespace {

// Initial capacity of each libcuckoo map: enough buckets (and bucket locks)
// that two threads rarely contend, without libcuckoo's 2^16-bucket default.
constexpr std::size_t kInitialMapCapacity = 1 << 14;

// Every Db::Impl alive in the process, for the exit handler. Allocated once
// and never destroyed, so it outlives every static destructor.
struct LiveDbs {
  std::mutex mu;
  std::vector<Db::Impl*> impls;
  bool exiting = false;  // set by the exit handler; ~Db then leaks the Impl
};
LiveDbs& live_dbs() {
  static LiveDbs* const dbs = new LiveDbs();
  return *dbs;
}

bool exit_started() {
  LiveDbs& dbs = live_dbs();
  std::lock_guard<std::mutex> lock(dbs.mu);
  return dbs.exiting;
}

// Registered once, at the end of the first successful open. atexit handlers
// and static destructors run in the reverse order of registration (of the
// end of construction), so the handler runs:
//   - before the destructors of RocksDB's statics built during that first
//     open (Env::Default and the rest), which RocksDB's Flush and Close need;
//   - before the destructor of a host global constructed before it (a
//     namespace-scope std::unique_ptr<Db>), which then finds its Db closed.
// A Db in a function-local static constructed after it is destroyed first,
// while RocksDB is still whole, and closes itself as usual.
void register_exit_handler() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(&Db::Impl::close_all_at_exit); });
}

}  // namespace

// ---- calls and close ----

thread_local const Db::Impl::Call* Db::Impl::Call::innermost_ = nullptr;

Db::Impl::Call::Call(const Impl* impl, const char* what, bool write) : impl_(impl) {
  if (write) {
    status_ = impl->check_writable(what);
    if (!status_.ok()) return;
  }
  impl->calls_.fetch_add(1, std::memory_order_seq_cst);
  counted_ = true;
  if (impl->closed_.load(std::memory_order_seq_cst)) {
    status_ = closed_status(what);
    return;
  }
  outer_ = innermost_;
  innermost_ = this;
}

Db::Impl::Call::~Call() {
  if (!counted_) return;
  if (status_.ok()) innermost_ = outer_;
  impl_->end_call();
}

const Db::Impl::Call* Db::Impl::Call::innermost() { return innermost_; }

void Db::Impl::end_call() const {
  // seq_cst: when close() saw this call counted, this load sees closed_.
  if (calls_.fetch_sub(1, std::memory_order_seq_cst) == 1 && closed_.load(std::memory_order_seq_cst)) {
    std::lock_guard<std::mutex> lock(drain_mu_);  // close() is waiting or has not checked calls_ yet
    drained_.notify_all();
  }
}

bool Db::Impl::in_call_on_this_thread() const {
  for (const Call* c = Call::innermost(); c != nullptr; c = c->outer()) {
    if (c->impl() == this) return true;
  }
  return false;
}

void Db::Impl::close_all_at_exit() {
  LiveDbs& dbs = live_dbs();
  // Held throughout, so no ~Impl runs on another thread meanwhile.
  std::lock_guard<std::mutex> lock(dbs.mu);
  dbs.exiting = true;
  for (Impl* impl : dbs.impls) (void)impl->close();
}

// ---- Db::Impl ----

Db::Impl::Impl(const Options& options, std::unique_ptr<Storage> storage)
    : options_(options),
      storage_(std::move(storage)),
      clock_(options.clock, [this](std::uint64_t floor) { return store_clock_lease(floor); }),
      communities_(kInitialMapCapacity),
      leave_status_(kInitialMapCapacity),
      held_back_(kInitialMapCapacity),
      state_(std::make_unique<StateStore>(storage_.get(),
                                          StateStore::Config{options.aggregate_write_period, options.write_buffer_bytes,
                                                             [this] { return signals_accepted(); }},
                                          [this] { return grace_.synchronize_all(); })) {
  LiveDbs& dbs = live_dbs();
  std::lock_guard<std::mutex> lock(dbs.mu);
  dbs.impls.push_back(this);
}

Db::Impl::~Impl() {
  LiveDbs& dbs = live_dbs();
  std::lock_guard<std::mutex> lock(dbs.mu);
  dbs.impls.erase(std::find(dbs.impls.begin(), dbs.impls.end(), this));
}

Result<std::unique_ptr<Db>> Db::Impl::open(const std::string& path, const Options& options, rocksdb::Env* env) {
  return guarded("open", [&]() -> Result<std::unique_ptr<Db>> {
    grace::init();
    if (options.aggregate_write_period.count() <= 0) {
      return Status::InvalidArgument("cannot open tidal Db at '" + path + "': Options::aggregate_write_period is " +
                                     std::to_string(options.aggregate_write_period.count()) +
                                     " ms; it must be at least 1 ms");
    }
    Storage::Config config;
    config.create_if_missing = options.create_if_missing;
    config.read_only = options.read_only;
    config.env = env;
    config.block_cache_bytes = options.block_cache_bytes;
    // Without sync_writes, membership writes become durable within a period
    // (docs/CONTRACT.md, G1).
    if (!options.sync_writes) config.users_wal_sync_period = options.aggregate_write_period;
    config.defer_upgrade = true;
    config.state_manifest_per_edit = options.strict_erasure;
    Result<std::unique_ptr<Storage>> storage = Storage::open(path, config);
    if (!storage.ok()) return storage.status();

    auto impl = std::make_unique<Impl>(options, std::move(*storage));
    Storage& st = *impl->storage_;
    // Every check that can refuse the open comes before the upgrade of a
    // format-2 Db, on its format-2 records (Storage::upgrade_pending), so an
    // open that fails leaves it in format 2 (docs/CONTRACT.md E3). Until
    // then only the users engine is written (the index backfill, which
    // format 2 keeps the same way).
    if (Status s = StateStore::check_format(st); !s.ok()) return s;
    if (Status s = impl->check_feed_options(); !s.ok()) return s;
    if (Status s = impl->check_journal_options(); !s.ok()) return s;
    if (Status s = impl->check_key_encryption(); !s.ok()) return s;
    if (Status s = ensure_index(st); !s.ok()) return s;
    if (Status s = rebuild_community_memberships(st, &impl->communities_); !s.ok()) return s;
    LeaveRebuildResult leaves;
    if (Status s = rebuild_community_leave_status(st, options.corrupt_record_policy, &impl->leave_status_,
                                                  &impl->gate_, &leaves);
        !s.ok()) {
      return s;
    }
    impl->corrupt_treated_as_left_.store(leaves.corrupt_treated_as_left, std::memory_order_relaxed);
    Result<std::uint64_t> floor = read_clock_floor(st);
    if (!floor.ok()) return floor.status();
    if (Result<std::uint64_t> epoch = StateStore::stored_epoch(st); !epoch.ok()) return epoch.status();
    if (Status s = st.finish_upgrade(); !s.ok()) return s;
    if (!options.read_only) {
      if (Status s = finish_key_encryption(st); !s.ok()) return s;
    }
    if (Status s = impl->open_feed(); !s.ok()) return s;
    if (Status s = impl->open_journal(); !s.ok()) return s;
    if (Status s = impl->load_recovery_state(); !s.ok()) return s;
    impl->clock_.start_above(std::max(*floor, leaves.max_timestamp));
    if (!options.read_only) {
      impl->remove_unfinished_backups();
      // Leased stamps are taken only for a ContributionSink: with one, the
      // lease's early renewals run on the clock's thread, not in a signal.
      if (options.contribution_sink) impl->clock_.start_renewing();
      if (Status s = impl->state_->start(); !s.ok()) return s;
      // A purge whose intent is journaled but whose batch a crash (or an
      // error) cut off: finished before any call can see the user.
      if (Status s = impl->finish_journaled_purges(); !s.ok()) return s;
      // A purge whose erasure failed or was cut short by a crash: finish it.
      // If it fails again the Db still opens; the receipts keep showing
      // erasure_complete == false until a later purge or open finishes it.
      (void)impl->complete_pending_erasures();
    }
    register_exit_handler();
    return std::unique_ptr<Db>(new Db(std::move(impl)));
  });
}

Status Db::Impl::check_feed_options() {
  Result<std::optional<std::uint64_t>> stored = ChangeFeed::stored_shard(*storage_);
  if (!stored.ok()) return stored.status();
  if (!options_.change_feed && *stored && !options_.read_only) {
    return Status::InvalidArgument("cannot open tidal Db at '" + storage_->path() + "': it keeps a change feed (shard " +
                                   std::to_string(**stored) +
                                   "), and a writable open without Options::change_feed would leave changes out of "
                                   "it; open it with change_feed = true and shard_id = " +
                                   std::to_string(**stored));
  }
  if (!options_.change_feed && !*stored) return Status::OK();
  if (options_.read_only && !*stored) {
    return Status::InvalidArgument("cannot open tidal Db at '" + storage_->path() +
                                   "' read-only with Options::change_feed: it keeps no change feed yet");
  }
  return ChangeFeed::check(storage_.get(), options_.change_feed ? options_.shard_id : **stored);
}

Status Db::Impl::open_feed() {
  Result<std::optional<std::uint64_t>> stored = ChangeFeed::stored_shard(*storage_);
  if (!stored.ok()) return stored.status();
  if (!options_.change_feed && !*stored) return Status::OK();
  // Read-only without change_feed: the stored feed, to read (nothing is written).
  const std::uint64_t shard = options_.change_feed ? options_.shard_id : **stored;
  Result<std::unique_ptr<ChangeFeed>> feed = ChangeFeed::open(storage_.get(), shard, options_.change_feed_max_bytes);
  if (!feed.ok()) return feed.status();
  feed_ = std::move(*feed);
  state_->set_feed(feed_.get());
  return Status::OK();
}

Status Db::Impl::check_journal_options() {
  const std::string where = "cannot open tidal Db at '" + storage_->path() + "'";
  if (options_.journal_wait.count() < 0) {
    return Status::InvalidArgument(where + ": Options::journal_wait is " + std::to_string(options_.journal_wait.count()) +
                                   " ms; it must be 0 (asynchronous replication) or more");
  }
  if (options_.journal_wait.count() > 0 && !options_.journal) {
    return Status::InvalidArgument(where + ": Options::journal_wait (" + std::to_string(options_.journal_wait.count()) +
                                   " ms) waits for the privacy journal's confirmation, and Options::journal is off");
  }
  Result<std::optional<std::uint64_t>> stored = Journal::stored_shard(*storage_);
  if (!stored.ok()) return stored.status();
  if (!options_.journal && *stored && !options_.read_only) {
    return Status::InvalidArgument(where + ": it keeps a privacy journal (shard " + std::to_string(**stored) +
                                   "), and a writable open without Options::journal would leave leaves, rejoins and "
                                   "purges out of it; open it with journal = true and shard_id = " +
                                   std::to_string(**stored));
  }
  if (!options_.journal && !*stored) return Status::OK();
  if (options_.read_only && !*stored) {
    return Status::InvalidArgument(where + " read-only with Options::journal: it keeps no privacy journal yet");
  }
  return Journal::check(*storage_, options_.journal ? options_.shard_id : **stored);
}

Status Db::Impl::open_journal() {
  Result<std::optional<std::uint64_t>> stored = Journal::stored_shard(*storage_);
  if (!stored.ok()) return stored.status();
  if (!options_.journal && !*stored) return Status::OK();
  // Read-only without journal: the stored journal, to read (nothing is written).
  const std::uint64_t shard = options_.journal ? options_.shard_id : **stored;
  Result<std::unique_ptr<Journal>> journal =
      Journal::open(storage_.get(), shard, Storage::durable_if(options_.sync_writes));
  if (!journal.ok()) return journal.status();
  journal_ = std::move(*journal);
  return Status::OK();
}

Status Db::Impl::check_writable(const char* what) const {
  if (closed_.load(std::memory_order_acquire)) return closed_status(what);
  if (options_.read_only) {
    return Status::InvalidArgument(std::string(what) + ": the Db at '" + storage_->path() + "' is open read-only");
  }
  return check_outside_sink(what);
}

Status Db::Impl::check_outside_sink(const char* what) {
  if (grace::in_read_section()) {
    return Status::Busy(std::string(what) + " called from inside a ContributionSink callback; call it afterwards");
  }
  return Status::OK();
}

// Serialized by the clock's lease lock; the clock only ever passes a larger
// floor while the Db is open (and last() at close).
Status Db::Impl::store_clock_lease(std::uint64_t floor) {
  rocksdb::WriteBatch batch;
  batch.Put(storage_->meta(), kClockLeaseKey, serialize_clock_floor(floor));
  return storage_->write(Storage::Engine::Users, &batch, Storage::durable_if(options_.sync_writes),
                         "clock lease (floor " + std::to_string(floor) + " ns)");
}

Status Db::Impl::flush() {
  return guarded("flush", [&]() -> Status {
    Call call(this, "flush", /*write=*/true);
    if (!call.status().ok()) return call.status();
    return state_->flush();
  });
}

Status Db::Impl::check_key_encryption() {
  std::optional<std::string> kek;
  if (options_.key_encryption_key) {
    Result<std::string> k = options_.key_encryption_key();
    if (!k.ok()) {
      return Status(k.status().code(), "cannot open tidal Db at '" + storage_->path() +
                                           "': Options::key_encryption_key failed: " + k.status().message());
    }
    kek = std::move(*k);
  }
  Status s = open_key_encryption(*storage_, kek, options_.read_only);
  if (kek) wipe(&*kek);
  return s;
}

Status Db::Impl::rotate_key_encryption_key(const std::string& new_key) {
  return guarded("rotate_key_encryption_key", [&]() -> Status {
    Call call(this, "rotate_key_encryption_key", /*write=*/true);
    if (!call.status().ok()) return call.status();
    return rotate_key_encryption(*storage_, new_key);
  });
}

// Writer-preferring: closed_ is published first, so every call that starts
// afterwards returns Closed at once, and close() waits only for the calls
// and signals already in flight. None of them waits for close(): a write
// from a sink callback is refused (Busy) before it counts itself.
Status Db::Impl::close() {
  return guarded("close", [&]() -> Status {
    if (Status s = check_outside_sink("close"); !s.ok()) return s;
    if (in_call_on_this_thread()) {
      return Status::Busy("close called from inside a for_each_left callback of the same Db; call it afterwards");
    }
    std::lock_guard<std::mutex> closing(close_mu_);
    if (closed_.exchange(true, std::memory_order_seq_cst)) return Status::OK();
    // Calls waiting for the journal's confirmation return now (NotReplicated).
    if (journal_) journal_->shutdown();
    {
      std::unique_lock<std::mutex> lock(drain_mu_);
      drained_.wait(lock, [&] { return calls_.load(std::memory_order_seq_cst) == 0; });
    }
    // Signals that saw the Db open have finished. If the barrier failed, a
    // signal may still be running: the wait still covered every section it
    // could see, the close goes on (the Db stays closed) and reports it.
    const Status barrier = grace_.synchronize_all();
    Status result = options_.read_only ? Status::OK() : state_->stop();
    clock_.stop_renewing();
    if (!options_.read_only && result.ok()) result = clock_.release_lease();  // no time is handed out now
    Status s = storage_->close();
    if (!barrier.ok()) return barrier;
    return result.ok() ? s : result;
  });
}

// ---- Db construction and destruction ----

Db::Db(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Db::~Db() {
  if (!impl_) return;
  (void)impl_->close();
  // Past the exit handler RocksDB's statics may be gone: leave the Impl
  // (closed, and still listed, so not a leak) to the operating system.
  if (exit_started()) (void)impl_.release();
}

}  // namespace tidal
