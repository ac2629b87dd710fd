// The Db facade, open/close/flush and stats.
#include <algorithm>

#include "db/grace.h"
#include "db/guarded.h"
#include "db/impl.h"
#include "db/state_rebuild.h"
#include "storage/keys.h"

namespace tidal {
namespace {

// Initial capacity of each libcuckoo map: enough buckets (and bucket locks)
// that two threads rarely contend, without libcuckoo's 2^16-bucket default.
constexpr std::size_t kInitialMapCapacity = 1 << 14;

}  // namespace

// ---- Db::Impl ----

Db::Impl::Impl(const Options& options, std::unique_ptr<Storage> storage)
    : options_(options),
      storage_(std::move(storage)),
      clock_(options.clock, [this](std::uint64_t floor) { return store_clock_lease(floor); }),
      communities_(kInitialMapCapacity),
      leave_status_(kInitialMapCapacity),
      held_back_(kInitialMapCapacity) {}

Result<std::unique_ptr<Db>> Db::Impl::open(const std::string& path, const Options& options, rocksdb::Env* env) {
  return guarded("open", [&]() -> Result<std::unique_ptr<Db>> {
    grace::init();
    Storage::Config config;
    config.create_if_missing = options.create_if_missing;
    config.read_only = options.read_only;
    config.env = env;
    Result<std::unique_ptr<Storage>> storage = Storage::open(path, config);
    if (!storage.ok()) return storage.status();

    auto impl = std::make_unique<Impl>(options, std::move(*storage));
    Storage& st = *impl->storage_;
    if (Status s = ensure_index(st); !s.ok()) return s;
    if (Status s = rebuild_community_memberships(st, &impl->communities_); !s.ok()) return s;
    LeaveRebuildResult leaves;
    if (Status s = rebuild_community_leave_status(st, options.corrupt_record_policy, &impl->leave_status_,
                                                  &impl->gate_, &leaves);
        !s.ok()) {
      return s;
    }
    impl->corrupt_treated_as_left_.store(leaves.corrupt_treated_as_left, std::memory_order_relaxed);
    // A read-only Db serves scores from storage instead of loading them all.
    if (!options.read_only) {
      if (Status s = impl->aggregates_.restore(st); !s.ok()) return s;
    }
    Result<std::uint64_t> floor = read_clock_floor(st);
    if (!floor.ok()) return floor.status();
    impl->clock_.start_above(std::max(*floor, leaves.max_timestamp));
    return std::unique_ptr<Db>(new Db(std::move(impl)));
  });
}

Status Db::Impl::check_writable(const char* what) const {
  if (closed_.load(std::memory_order_acquire)) return closed_status(what);
  if (options_.read_only) {
    return Status::InvalidArgument(std::string(what) + ": the Db at '" + storage_->path() + "' is open read-only");
  }
  if (grace::in_read_section()) {
    return Status::Busy(std::string(what) + " called from inside a ContributionSink callback; call it afterwards");
  }
  return Status::OK();
}

void Db::Impl::put_clock_floor(rocksdb::WriteBatch* batch, std::uint64_t user_id, std::uint64_t ts) {
  // One record per lock stripe: writes to it are serialized by that stripe's
  // lock, so each record only ever grows.
  std::string key = kClockFloorPrefix;
  put_u64_be(&key, user_id % user_locks_.size());
  std::string value;
  put_u64_le(&value, ts);
  batch->Put(storage_->meta(), key, value);
}

// Serialized by the clock's lease lock; the clock only ever passes a larger
// floor while the Db is open (and last() at close).
Status Db::Impl::store_clock_lease(std::uint64_t floor) {
  std::string value;
  put_u64_le(&value, floor);
  rocksdb::WriteBatch batch;
  batch.Put(storage_->meta(), kClockLeaseKey, value);
  return storage_->write(&batch, Storage::durable_if(options_.sync_writes),
                         "clock lease (floor " + std::to_string(floor) + " ns)");
}

// The clock's lease covers every time handed out, so the aggregates carry no
// clock floor of their own.
Status Db::Impl::persist_aggregates() {
  rocksdb::WriteBatch batch;
  return aggregates_.persist(*storage_, &batch);
}

Status Db::Impl::flush() {
  return guarded("flush", [&]() -> Status {
    std::shared_lock lock(lifecycle_);
    if (Status s = check_writable("flush"); !s.ok()) return s;
    return persist_aggregates();
  });
}

Status Db::Impl::close() {
  return guarded("close", [&]() -> Status {
    if (grace::in_read_section()) {
      return Status::Busy("close called from inside a ContributionSink callback; call it afterwards");
    }
    std::unique_lock lock(lifecycle_);
    if (closed_.exchange(true, std::memory_order_acq_rel)) return Status::OK();
    grace::synchronize();  // signals that saw the Db open have finished
    Status result = options_.read_only ? Status::OK() : persist_aggregates();
    if (!options_.read_only && result.ok()) result = clock_.release_lease();  // no time is handed out now
    Status s = storage_->close();
    return result.ok() ? s : result;
  });
}

CounterStripe& Db::Impl::counters() {
  static std::atomic<unsigned> next_thread{0};
  thread_local const unsigned index = next_thread.fetch_add(1, std::memory_order_relaxed);
  return stripes_[index % stripes_.size()];
}

Stats Db::Impl::stats() const {
  Stats out;
  for (const CounterStripe& c : stripes_) {
    out.signals += c.signals.load(std::memory_order_relaxed);
    out.cohort_attributions += c.cohort_attributions.load(std::memory_order_relaxed);
    out.community_forwards += c.community_forwards.load(std::memory_order_relaxed);
    out.gated_cohort += c.gated_cohort.load(std::memory_order_relaxed);
    out.gated_community += c.gated_community.load(std::memory_order_relaxed);
  }
  out.personal_updates = out.signals;  // every accepted signal updates the personal layer
  out.leaves = leaves_.load(std::memory_order_relaxed);
  out.rejoins = rejoins_.load(std::memory_order_relaxed);
  out.users_left = gate_.closed_count();
  out.corrupt_records_treated_as_left = corrupt_treated_as_left_.load(std::memory_order_relaxed);
  return out;
}

double Db::Impl::score(AggregateKind kind, AggregateKey key) const {
  if (closed_.load(std::memory_order_acquire)) return 0.0;
  try {
    if (!options_.read_only) return aggregates_.score(kind, key);
    std::shared_lock lifecycle(lifecycle_);
    Result<double> stored = Aggregates::read_stored(*storage_, kind, key);
    return stored.ok() ? *stored : 0.0;
  } catch (...) {
    return 0.0;
  }
}

// ---- Db facade ----

Db::Db(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Db::~Db() {
  if (impl_) (void)impl_->close();
}

Result<std::unique_ptr<Db>> Db::open(const std::string& path, const Options& options) {
  return Impl::open(path, options, nullptr);
}
Status Db::close() { return impl_->close(); }
Status Db::flush() { return impl_->flush(); }
Status Db::join_community(std::uint64_t user_id, std::uint64_t community_id) {
  return impl_->join_community(user_id, community_id);
}
Status Db::exit_community(std::uint64_t user_id, std::uint64_t community_id) {
  return impl_->exit_community(user_id, community_id);
}
Result<std::vector<std::uint64_t>> Db::communities_of(std::uint64_t user_id) const {
  return impl_->communities_of(user_id);
}
Result<SignalOutcome> Db::signal_with_context(const Signal& signal, const SignalContext& context) {
  return impl_->signal_with_context(signal, context);
}
double Db::personal_score(std::uint64_t user_id, std::uint64_t item_id) const {
  return impl_->score(AggregateKind::Personal, {user_id, item_id});
}
double Db::cohort_score(std::uint64_t cohort_id, std::uint64_t item_id) const {
  return impl_->score(AggregateKind::Cohort, {cohort_id, item_id});
}
double Db::community_score(std::uint64_t community_id, std::uint64_t item_id) const {
  return impl_->score(AggregateKind::Community, {community_id, item_id});
}
Status Db::leave_community_layer(std::uint64_t user_id) { return impl_->leave_community_layer(user_id); }
Status Db::rejoin_community_layer(std::uint64_t user_id) { return impl_->rejoin_community_layer(user_id); }
Result<CommunityMembership> Db::community_layer_status(std::uint64_t user_id) const {
  return impl_->community_layer_status(user_id);
}
Result<std::vector<MembershipEvent>> Db::community_layer_history(std::uint64_t user_id) const {
  return impl_->community_layer_history(user_id);
}
Result<GateActivity> Db::gate_activity(std::uint64_t user_id) const { return impl_->gate_activity(user_id); }
Status Db::for_each_left(const std::function<bool(const CommunityMembership&)>& fn) const {
  return impl_->for_each_left(fn);
}
Result<VerifyReport> Db::verify() const { return impl_->verify(); }
Stats Db::stats() const { return impl_->stats(); }

}  // namespace tidal
