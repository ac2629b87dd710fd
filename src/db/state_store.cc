#include "db/state_store.h"

#include <algorithm>
#include <cstring>
#include <future>
#include <system_error>
#include <vector>

#include <rocksdb/write_batch.h>

#include "storage/ingest_batch.h"
#include "storage/ledger_scan.h"

namespace tidal {
namespace {

// Initial buckets per buffer: enough bucket locks that two signaling threads
// rarely contend; the map grows up to the configured bound.
constexpr std::size_t kInitialBufferCapacity = 1 << 14;
// Bytes a buffered cell costs, with libcuckoo's slack: sizes the bounds.
constexpr std::size_t kBytesPerCell = 128;
// The writer starts a drain when the active buffer holds this share of its
// bound (the soft bound); past it signals slow down. The larger the batches,
// the cheaper each key is to write: at 3/4 instead of 1/4 the writer wrote
// batches of ~30k signals instead of ~11k and sustained 25-35 % more signals
// a second (bench/README.md, "The soft bound"); the longest signal call while
// flush() runs stayed under 20 ms.
constexpr std::uint64_t kSoftBoundNum = 3, kSoftBoundDen = 4;
// The longest pause admit() adds to one signal below the hard bound, reached
// by the square of the fill between the bounds. Short pauses instead of one
// long wait: at 1 ms (linear) signals crossed from the soft to the hard
// bound in ~2 s, and while a batch write took longer than that (fsyncs on a
// disk busy with compactions) a signal waited at the hard bound for the
// rest of it: 2.1 s at 1M users (bench/README.md, issue 21).
constexpr std::uint64_t kMaxPauseMicros = 10'000;
// How often the writer looks at the compaction debt (RocksDB properties,
// each a lock of its mutex: too costly for every signal) and sets the
// admission rate.
constexpr auto kDebtLookPeriod = std::chrono::milliseconds(20);
// The window over which the writer measures the byte rate of its batches
// (the base rate, when no limit was in force in it): several periods, so
// that a batch more or less in it changes the rate little. A window with a
// limit in force keeps the base rate as it was; one without sets it to
// max(the rate measured, the old base rate faded by kBaseRateFade), so a
// short lull does not drop it, a long idle time does (to kMinBaseRate).
constexpr auto kRateWindow = std::chrono::seconds(5);
constexpr double kBaseRateFade = 0.9;
// The bytes a signal costs follow the batches, smoothed: new = old +
// kSignalBytesWeight * (batch's - old).
constexpr double kSignalBytesWeight = 0.25;

std::int64_t steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

std::uint64_t ns_since(std::chrono::steady_clock::time_point start) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}

// Raises `max` to at least `v`.
void raise_to(std::atomic<std::uint64_t>& max, std::uint64_t v) {
  for (std::uint64_t seen = max.load(std::memory_order_relaxed);
       seen < v && !max.compare_exchange_weak(seen, v, std::memory_order_relaxed);) {
  }
}

// Where `v` is in [start, full], 0 to 1.
double share(std::uint64_t v, std::uint64_t start, std::uint64_t full) {
  if (v <= start) return 0;
  if (v >= full) return 1;
  return static_cast<double>(v - start) / static_cast<double>(full - start);
}

}  // namespace

StateStore::StateStore(Storage* storage, const Config& config, std::function<Status()> quiesce)
    : storage_(storage),
      config_(config),
      quiesce_(std::move(quiesce)),
      soft_limit_(std::max<std::uint64_t>(1, config.buffer_bytes / 2 / kBytesPerCell * kSoftBoundNum / kSoftBoundDen)),
      hard_limit_(std::max<std::uint64_t>(soft_limit_ + 1, config.buffer_bytes / 2 / kBytesPerCell)),
      buffers_{Buffer(kInitialBufferCapacity), Buffer(kInitialBufferCapacity)},
      window_start_(std::chrono::steady_clock::now()) {}

StateStore::~StateStore() { (void)stop(); }

Status StateStore::check_format(Storage& storage) { return storage.check_state_format(); }

Result<std::uint64_t> StateStore::stored_epoch(const Storage& storage) {
  std::string stored;
  Status s = storage.get(storage.state_meta(), kStateEpochKey, &stored);
  if (s.code() == StatusCode::NotFound) return std::uint64_t{0};
  if (!s.ok()) return s;
  if (stored.size() != 8) {
    return Status::Corruption("the state store's epoch record of '" + storage.path() + "' has " +
                              std::to_string(stored.size()) + " bytes; expected 8");
  }
  return get_u64_be(stored.data());
}

Status StateStore::start() {
  Result<std::uint64_t> stored = stored_epoch(*storage_);
  if (!stored.ok()) return stored.status();
  // Also above the users engine's latest sequence number: it is format 2's
  // one engine, whose sequence numbers named every ledger record a format-2
  // Db holds (tidal 0.2.0 used them as epochs) and only ever grow. So a Db
  // that an upgrade left without a high enough state_epoch (tidal 0.3.0
  // copied it only when present) still never reuses such an epoch, at the
  // cost of one read instead of a scan of the ledger.
  last_epoch_ = std::max(*stored, storage_->db(Storage::Engine::Users)->GetLatestSequenceNumber());
  reserved_epoch_ = *stored;  // what a synced mark reserved; the first batch above it writes one
  writer_ = std::thread([this] { run_writer(); });
  return Status::OK();
}

Status StateStore::stop() {
  {
    std::lock_guard<std::mutex> lock(writer_mu_);
    if (stop_) return Status::OK();
    stop_ = true;
  }
  writer_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  Status s = flush();
  // Wake signals blocked in admit(): the Db is closing under them.
  drained_cv_.notify_all();
  std::unique_lock<std::shared_mutex> view(view_mu_);
  if (frozen_live_) {
    // The last batch could not be written; its deltas are lost with this
    // handle, which `s` reports. The snapshot must not outlive the database.
    storage_->db(Storage::Engine::State)->ReleaseSnapshot(frozen_snapshot_);
    frozen_snapshot_ = nullptr;
    frozen_live_ = false;
  }
  return s;
}

void StateStore::wake_writer() {
  {
    std::lock_guard<std::mutex> lock(writer_mu_);
    if (wake_) return;  // woken already (or failing, and waiting for its period)
    wake_ = true;
  }
  writer_cv_.notify_one();
}

void StateStore::feed_trimmed() {
  {
    std::lock_guard<std::mutex> lock(writer_mu_);
    if (last_error_.ok()) return;
    retry_ = true;
  }
  writer_cv_.notify_one();
}

void StateStore::run_writer() {
  std::unique_lock<std::mutex> lock(writer_mu_);
  // Batches start write_period apart (start to start), or sooner when the
  // soft bound wakes the writer; between them the writer looks at the debt.
  // After a failed batch only the period (or a trim of the feed) starts the
  // next try: the soft bound, which every signal past it keeps reaching,
  // would start one at once, again and again.
  auto next = std::chrono::steady_clock::now() + config_.write_period;
  writer_due_ns_.store(steady_ns(next), std::memory_order_relaxed);
  bool failing = false;
  const auto woken = [&] { return retry_ || (wake_ && !failing); };
  while (!stop_) {
    const auto look = std::chrono::steady_clock::now() + kDebtLookPeriod;
    writer_cv_.wait_until(lock, std::min(next, look), [&] { return stop_ || woken(); });
    if (stop_) break;
    lock.unlock();
    look_at_debt();
    lock.lock();
    const auto now = std::chrono::steady_clock::now();
    if (!woken() && now < next) continue;
    wake_ = false;
    retry_ = false;
    // Due at the deadline, or now when woken before it.
    const auto due = std::min(now, next);
    writer_due_ns_.store(steady_ns(due), std::memory_order_relaxed);
    next = now + config_.write_period;
    lock.unlock();
    failing = !flush_due(due).ok();  // the outcome is kept in last_error_ and the counters
    writer_due_ns_.store(steady_ns(next), std::memory_order_relaxed);
    lock.lock();
  }
  writer_due_ns_.store(0, std::memory_order_relaxed);
}

void StateStore::look_at_debt() {
  const Storage::CompactionDebt debt = storage_->compaction_debt();
  debt_bytes_.store(debt.pending_bytes, std::memory_order_relaxed);
  debt_l0_files_.store(debt.l0_files, std::memory_order_relaxed);
  const double x = std::max(share(debt.pending_bytes, Storage::kDebtStartBytes, Storage::kDebtFullBytes),
                            share(debt.l0_files, Storage::kDebtStartL0Files, Storage::kDebtFullL0Files));
  // The base rate: what the batches wrote over the last window, unless a
  // limit held them back in it.
  const auto now = std::chrono::steady_clock::now();
  if (now - window_start_ >= kRateWindow) {
    const std::uint64_t bytes = batch_bytes_.load(std::memory_order_relaxed);
    const double seconds = std::chrono::duration<double>(now - window_start_).count();
    if (!window_limited_) {
      base_rate_ = std::max({static_cast<double>(bytes - window_bytes_) / seconds, base_rate_ * kBaseRateFade,
                             kMinBaseRate});
    }
    window_start_ = now;
    window_bytes_ = bytes;
    window_limited_ = false;
  }
  if (x == 0) {
    interval_ns_.store(0, std::memory_order_relaxed);
    rate_bytes_.store(0, std::memory_order_relaxed);
    return;
  }
  window_limited_ = true;
  if (x >= 1) {
    interval_ns_.store(kStopped, std::memory_order_relaxed);
    rate_bytes_.store(0, std::memory_order_relaxed);
    return;
  }
  const double rate = std::max(base_rate_ * (1 - x) * (1 - x), base_rate_ / kMinRateShare);
  const double measured = signal_bytes_.load(std::memory_order_relaxed);
  const double per_signal = measured > 0 ? measured : static_cast<double>(kDefaultSignalBytes);
  rate_bytes_.store(static_cast<std::uint64_t>(rate), std::memory_order_relaxed);
  interval_ns_.store(std::max<std::uint64_t>(1, static_cast<std::uint64_t>(per_signal * 1e9 / rate)),
                     std::memory_order_relaxed);
}

void StateStore::pace(std::uint64_t interval_ns) {
  // GCRA: each signal takes the next free slot, max(tat, now), and moves
  // tat one interval past it; it sleeps until kAdmissionBurst before its
  // slot. Slots are an interval apart and none lies before the call, so in
  // any time T at most (T + kAdmissionBurst) / interval + 1 signals return,
  // however many threads call. Relaxed: the slot is all a caller takes
  // from tat_ns_, and the CAS orders the slots.
  const std::int64_t now = steady_ns(std::chrono::steady_clock::now());
  const auto interval = static_cast<std::int64_t>(interval_ns);
  std::int64_t tat = tat_ns_.load(std::memory_order_relaxed);
  std::int64_t slot;
  do {
    slot = std::max(tat, now);
  } while (!tat_ns_.compare_exchange_weak(tat, slot + interval, std::memory_order_relaxed));
  const std::int64_t wait = slot - now - std::chrono::nanoseconds(kAdmissionBurst).count();
  if (wait <= 0) return;
  delayed_signals_.fetch_add(1, std::memory_order_relaxed);
  const auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::nanoseconds(wait));
  const std::uint64_t slept = ns_since(start);
  delay_ns_.fetch_add(slept, std::memory_order_relaxed);
  raise_to(delay_max_ns_, slept);
}

Status StateStore::refused() const {
  return Status::Busy(
      "signal_with_context: refused by admission control: the state store's compactions are too far behind "
      "(compaction debt " + std::to_string(debt_bytes_.load(std::memory_order_relaxed)) + " bytes, " +
      std::to_string(debt_l0_files_.load(std::memory_order_relaxed)) +
      " level-0 files; signals are refused from " + std::to_string(Storage::kDebtFullBytes) + " bytes or " +
      std::to_string(Storage::kDebtFullL0Files) +
      " files until the compactions catch up); the signal was not applied, retry it later");
}

Status StateStore::admit(bool nested) {
  // At the change feed's bound a signal is refused before it is accepted
  // (F4): what was accepted is always written, so a downstream outage never
  // loses an acknowledged signal, at the bound or at close.
  if (feed_ != nullptr && feed_->full()) {
    feed_refused_signals_.fetch_add(1, std::memory_order_relaxed);
    const Status room = feed_->room();
    if (!room.ok()) return Status::Busy(room.message() + "; the signal was not applied");
  }
  // The admission rate, while the compactions are behind. A nested signal
  // is never held to it (it would hold up the sink's caller, whose read
  // section the writer may be waiting out); at the hard stop, where nothing
  // waits, it is refused like any other.
  if (const std::uint64_t interval = interval_ns_.load(std::memory_order_relaxed); interval != 0) {
    if (interval == kStopped) {
      refused_signals_.fetch_add(1, std::memory_order_relaxed);
      return refused();
    }
    if (!nested) pace(interval);
  }
  const std::uint64_t fill = entries_[active_.load(std::memory_order_acquire)].load(std::memory_order_relaxed);
  if (fill < soft_limit_) return Status::OK();
  wake_writer();
  if (nested) {
    if (fill < hard_limit_) return Status::OK();
    backpressure_waits_.fetch_add(1, std::memory_order_relaxed);
    return Status::Busy(
        "signal_with_context called from inside a ContributionSink callback while the write buffers are full: "
        "waiting for the writer there could deadlock (the writer waits for the callback's own signal); the signal "
        "was not applied, make it after the callback returns");
  }
  if (fill < hard_limit_) {
    // Between the soft and the hard bound, slow each signal a little, more
    // the fuller the buffer, so that the writer catches up before anyone
    // would have to wait for a whole write.
    const double x = static_cast<double>(fill - soft_limit_) / static_cast<double>(hard_limit_ - soft_limit_);
    const auto pause = std::chrono::microseconds(static_cast<std::uint64_t>(x * x * kMaxPauseMicros));
    if (pause.count() > 0) {
      backpressure_waits_.fetch_add(1, std::memory_order_relaxed);
      const auto start = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(pause);
      raise_to(backpressure_max_ns_, ns_since(start));
    }
    return Status::OK();
  }
  // Past the hard bound: wait for the writer to swap the buffers.
  backpressure_waits_.fetch_add(1, std::memory_order_relaxed);
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(writer_mu_);
  while (entries_[active_.load(std::memory_order_acquire)].load(std::memory_order_relaxed) >= hard_limit_) {
    if (!last_error_.ok()) return last_error_;
    if (stop_) return Status::Closed("signal_with_context: the Db is closing");
    drained_cv_.wait_for(lock, std::chrono::milliseconds(10));
  }
  lock.unlock();
  raise_to(backpressure_max_ns_, ns_since(start));
  return Status::OK();
}

Status StateStore::flush() { return flush_due(std::chrono::steady_clock::now()); }

Status StateStore::flush_due(std::chrono::steady_clock::time_point due) {
  std::lock_guard<std::mutex> drain(drain_mu_);
  return drain_all_locked(due);
}

Status StateStore::drain_all_locked(std::chrono::steady_clock::time_point due) {
  // A batch that failed earlier is still frozen: drain_locked() writes it
  // first, and the active buffer takes a second drain. (frozen_live_ changes
  // only under drain_mu_, which the caller holds.)
  const std::uint64_t writes = writes_.load(std::memory_order_relaxed);
  const bool retry = frozen_live_;
  Status s = drain_locked();
  if (s.ok() && retry) s = drain_locked();
  if (s.ok() && writes_.load(std::memory_order_relaxed) != writes) {
    const auto took = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - due);
    const auto ns = static_cast<std::uint64_t>(std::max<std::int64_t>(0, took.count()));
    std::lock_guard<std::mutex> lock(write_times_mu_);
    write_max_ns_ = std::max(write_max_ns_, ns);
    if (recent_writes_.size() < kRecentWrites) {
      recent_writes_.push_back(ns);
    } else {
      recent_writes_[recent_next_] = ns;
      recent_next_ = (recent_next_ + 1) % kRecentWrites;
    }
  }
  {
    std::lock_guard<std::mutex> lock(writer_mu_);
    last_error_ = s;
  }
  drained_cv_.notify_all();
  return s;
}

Status StateStore::drain_locked() {
  int frozen;
  {
    std::unique_lock<std::shared_mutex> view(view_mu_);
    if (frozen_live_) {
      // The last batch failed: write that buffer again before taking more.
      frozen = 1 - active_.load(std::memory_order_relaxed);
    } else {
      frozen = active_.load(std::memory_order_relaxed);
      if (entries_[frozen].load(std::memory_order_relaxed) == 0) return Status::OK();
      frozen_snapshot_ = storage_->db(Storage::Engine::State)->GetSnapshot();
      frozen_live_ = true;
      frozen_buffer_ = swaps_.load(std::memory_order_relaxed) + 1;
      // Before the index: a signal that reads the new index, and so adds to
      // the next buffer, was counted there by any leave that waits it out.
      swaps_.store(frozen_buffer_, std::memory_order_release);
      active_.store(1 - frozen, std::memory_order_release);
      // The signals counted so far: about those in the batch and before it
      // (a signal is counted as it returns, so a few in flight go to the
      // next batch's count; over batches it evens out).
      if (config_.signals) frozen_signals_ = config_.signals();
    }
  }
  // Signals that read the old index may still be adding to the frozen buffer.
  // If that cannot be made sure of, the buffer stays frozen and live (readers
  // see it) and the next drain tries again.
  if (Status s = quiesce_(); !s.ok()) {
    write_failures_.fetch_add(1, std::memory_order_relaxed);
    return s;
  }
  // The swap above may have left the new active buffer over the bound for
  // nobody: let waiting signals look again.
  drained_cv_.notify_all();
  return write_frozen_locked(frozen);
}

Status StateStore::write_frozen_locked(int frozen) {
  Buffer& buffer = buffers_[frozen];
  std::vector<std::pair<Cell, Units>> cells;
  {
    auto locked = buffer.lock_table();  // uncontended: no signal adds to it any more
    cells.assign(locked.begin(), locked.end());
  }
  const std::string what = "aggregate write of '" + storage_->path() + "'";
  // The batch's epoch names its ledger records, so no two batches may share
  // one, after a crash or an upgrade too: it is above the last batch's and
  // RocksDB's next sequence number, and at most the reservation in the
  // state_epoch record, which a synced mark raises (by epoch_lease) before
  // any batch takes an epoch above it. A new StateStore starts above the
  // stored record, so above every epoch a stored batch can have: those
  // were all reserved, synced, before their batch was written. The
  // ingestion alone would not do: it need not take a sequence number of its
  // own (a file that overlaps nothing goes in at 0; only because the frozen
  // snapshot is held does RocksDB 7.8 give it one), and a Db upgraded from
  // format 2 has ledger records named by the old engine's sequence numbers,
  // above the new one's. The mark used to be written, and fsynced, for
  // every batch, besides the ingestion's own fsyncs; a reservation costs
  // that fsync once every few thousand batches.
  rocksdb::DB* db = storage_->db(Storage::Engine::State);
  const std::uint64_t epoch = std::max(db->GetLatestSequenceNumber(), last_epoch_) + 1;
  Status s;
  if (epoch > reserved_epoch_) {
    const std::uint64_t reserve = epoch + std::max<std::uint64_t>(epoch_lease, 1) - 1;
    rocksdb::WriteBatch mark;
    std::string value;
    put_u64_be(&value, reserve);
    mark.Put(storage_->state_meta(), kStateEpochKey, value);
    s = storage_->write(Storage::Engine::State, &mark, Storage::WriteMode::Sync, what);
    if (s.ok()) reserved_epoch_ = reserve;
  }
  if (s.ok()) last_epoch_ = epoch;
  std::uint64_t keys = 0, bytes = 0;
  std::unique_lock<std::mutex> store(store_mu_, std::defer_lock);  // held from the ingestion to the readers' switch
  if (s.ok()) s = write_batch_files(&cells, epoch, what, &store, &keys, &bytes);
  if (!s.ok()) {
    write_failures_.fetch_add(1, std::memory_order_relaxed);
    return s;  // the frozen buffer stays live: readers still see it, the next drain retries it
  }
  {
    std::unique_lock<std::shared_mutex> view(view_mu_);
    frozen_live_ = false;
    storage_->db(Storage::Engine::State)->ReleaseSnapshot(frozen_snapshot_);
    frozen_snapshot_ = nullptr;
  }
  stored_through_ = frozen_buffer_;
  {
    std::lock_guard<std::mutex> lock(leavers_mu_);
    std::erase_if(leavers_, [&](const auto& leaver) { return leaver.second <= stored_through_; });
  }
  store.unlock();
  buffer.clear();
  entries_[frozen].store(0, std::memory_order_relaxed);
  writes_.fetch_add(1, std::memory_order_relaxed);
  cells_written_.fetch_add(keys, std::memory_order_relaxed);
  batch_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  // The bytes a signal costs, from this batch.
  if (frozen_signals_ > written_signals_) {
    const double batch = static_cast<double>(bytes) / static_cast<double>(frozen_signals_ - written_signals_);
    const double old = signal_bytes_.load(std::memory_order_relaxed);
    signal_bytes_.store(old == 0 ? batch : old + kSignalBytesWeight * (batch - old), std::memory_order_relaxed);
    written_signals_ = frozen_signals_;
  }
  return Status::OK();
}

Status StateStore::resolve_ledger_keys(const std::vector<std::uint64_t>& users, std::vector<const SealingKey*>* keys,
                                       std::vector<std::pair<std::uint64_t, UserKey>>* created) {
  {
    std::lock_guard<std::mutex> lock(forgotten_mu_);
    for (const auto& [user, revoke] : forgotten_) {
      ledger_keys_.erase(user);
      if (revoke) revoked_keys_.insert(user);
    }
    forgotten_.clear();
  }
  // Each lookup asks for a slot this far ahead (LedgerKeyTable).
  constexpr std::size_t kAhead = 16;
  keys->assign(users.size(), nullptr);
  std::vector<std::uint64_t> unknown;  // neither held nor revoked: read from the key store
  std::vector<std::size_t> unknown_at, fresh_at;
  for (std::size_t i = 0; i < users.size(); ++i) {
    if (i + kAhead < users.size()) ledger_keys_.prefetch(users[i + kAhead]);
    if (const SealingKey* k = ledger_keys_.find(users[i])) {
      (*keys)[i] = k;
    } else if (revoked_keys_.contains(users[i])) {
      fresh_at.push_back(i);
    } else {
      unknown.push_back(users[i]);
      unknown_at.push_back(i);
    }
  }
  std::vector<std::optional<UserKey>> stored;
  if (Status s = read_user_keys(*storage_, unknown, &stored); !s.ok()) return s;
  for (std::size_t j = 0; j < unknown.size(); ++j) {
    if (stored[j]) (*keys)[unknown_at[j]] = ledger_keys_.insert(unknown[j], *stored[j]);
    else fresh_at.push_back(unknown_at[j]);
  }
  created->clear();
  created->reserve(fresh_at.size());  // no reallocation: keys points into it
  for (std::size_t i : fresh_at) {
    Result<UserKey> fresh = UserKey::generate();
    if (!fresh.ok()) return fresh.status();
    created->emplace_back(users[i], std::move(*fresh));
    (*keys)[i] = &created->back().second;
  }
  return Status::OK();
}

Status StateStore::write_batch_files(std::vector<std::pair<Cell, Units>>* cells, std::uint64_t epoch,
                                     const std::string& what, std::unique_lock<std::mutex>* store,
                                     std::uint64_t* keys, std::uint64_t* bytes) {
  // An SST file takes its entries in key order. An aggregate key is
  // [kind][owner BE][item BE], so (kind, a, b) order is its byte order; the
  // aggregates (kind <= Community) come first. A ledger cell's key is
  // [user BE][0x13][epoch], one record per user whose entries are sorted by
  // (target, target id, item): (a, kind, b, c) order. Sorting the fixed-size
  // cells needs no allocation per key.
  constexpr auto is_ledger = [](const Cell& c) { return c.kind > static_cast<std::uint8_t>(AggregateKind::Community); };
  std::sort(cells->begin(), cells->end(), [&](const auto& x, const auto& y) {
    const Cell& p = x.first;
    const Cell& q = y.first;
    if (is_ledger(p) != is_ledger(q)) return is_ledger(q);
    if (!is_ledger(p)) return std::tie(p.kind, p.a, p.b) < std::tie(q.kind, q.a, q.b);
    return std::tie(p.a, p.kind, p.b, p.c) < std::tie(q.a, q.kind, q.b, q.c);
  });
  IngestBatch files(storage_, std::to_string(epoch));
  // The shared cells' deltas also enter the change feed, in the same
  // ingestion. They are a run of the sorted cells (the cohort and community
  // aggregates, after the personal ones), so a second thread builds the
  // feed's file from that run, fsync included, while this one writes the
  // aggregates and the ledger. Done in line, the feed's encoding,
  // compression and fsync made each batch ~14 % longer, and the writer's
  // batches are what bounds the throughput (bench/README.md, "The feed's
  // cost (issue 29)"). The future is destroyed first, so the thread never
  // outlives what it reads.
  IngestBatch feed_file(storage_, std::to_string(epoch));
  std::future<Result<ChangeFeed::Appended>> feed_done;
  if (feed_ != nullptr) {
    const auto shared = std::partition_point(cells->begin(), cells->end(), [](const auto& c) {
      return c.first.kind < static_cast<std::uint8_t>(AggregateKind::Cohort);
    });
    const auto ledger = std::partition_point(shared, cells->end(), [&](const auto& c) { return !is_ledger(c.first); });
    auto build = [this, shared, ledger, &feed_file, &what]() -> Result<ChangeFeed::Appended> {
      ChangeFeed::Appender feed(feed_, FeedOrigin::Writer, [&](const std::string& k, const std::string& v) {
        return feed_file.put(storage_->feed(), k, v);
      });
      std::string key;
      for (auto it = shared; it != ledger; ++it) {
        key.clear();
        put_aggregate_key(&key, static_cast<AggregateKind>(it->first.kind), it->first.a, it->first.b);
        feed.add(key, it->second);
      }
      Result<ChangeFeed::Appended> appended = feed.finish();
      if (!appended.ok()) return appended;
      if (Status s = feed_file.finish(what); !s.ok()) return s;
      return appended;
    };
    try {
      feed_done = std::async(std::launch::async, build);
    } catch (const std::system_error&) {  // no thread to be had: build it here, at get()
      feed_done = std::async(std::launch::deferred, build);
    }
  }
  std::string key, units_value, record;  // record: the ledger entries of one user so far
  // The ledger's records, sealed with their users' keys and named by the
  // epoch and their pseudonyms (storage/sealed_ledger.h), each with its
  // index entry: in the pseudonyms' order, once all are sealed. The keys
  // made for users new to the ledger go into the key store (synced) before
  // the ingestion, so no record is ever stored without its key.
  struct SealedRecord {
    std::array<char, kSealedLedgerKeySize> name;
    std::size_t at, size;  // its value in sealed_values
  };
  std::vector<SealedRecord> sealed;
  std::string sealed_values;
  std::vector<std::pair<std::uint64_t, UserKey>> created;
  std::vector<const SealingKey*> user_keys;  // of each user with ledger cells, in order
  {
    std::vector<std::uint64_t> users;
    for (const auto& [cell, units] : *cells) {
      if (is_ledger(cell) && (users.empty() || users.back() != cell.a)) users.push_back(cell.a);
    }
    if (Status s = resolve_ledger_keys(users, &user_keys, &created); !s.ok()) {
      return Status(s.code(), what + ": " + s.message());
    }
  }
  std::size_t next_user = 0;
  *keys = 0;
  *bytes = 0;
  for (std::size_t i = 0; i < cells->size(); ++i) {
    const auto& [cell, units] = (*cells)[i];
    rocksdb::Status s;
    if (!is_ledger(cell)) {
      key.clear();
      put_aggregate_key(&key, static_cast<AggregateKind>(cell.kind), cell.a, cell.b);
      units_value.clear();
      put_units(&units_value, units);
      s = files.merge(storage_->aggregates(), key, units_value);
      *bytes += key.size() + units_value.size();
      ++*keys;
    } else {
      put_sealed_entry(&record, {static_cast<AggregateKind>(cell.kind - kLedgerKindOffset), cell.b, cell.c, units});
      if (i + 1 == cells->size() || (*cells)[i + 1].first.a != cell.a) {
        const SealingKey* user_key = user_keys[next_user++];
        SealedRecord& r = sealed.emplace_back(SealedRecord{user_key->record_name(epoch), sealed_values.size(), 0});
        if (Status seal = user_key->seal({r.name.data(), r.name.size()}, record, &sealed_values); !seal.ok()) {
          return Status(seal.code(), what + ": " + seal.message());
        }
        r.size = sealed_values.size() - r.at;
        *bytes += r.name.size() + r.size;
        record.clear();
        ++*keys;
      }
    }
    if (!s.ok()) return from_rocksdb(s, what);
  }
  // One epoch: in the pseudonyms' order, which is also the index keys'.
  std::sort(sealed.begin(), sealed.end(), [](const SealedRecord& x, const SealedRecord& y) {
    return std::memcmp(x.name.data(), y.name.data(), x.name.size()) < 0;  // bytewise, as RocksDB orders keys
  });
  for (const SealedRecord& r : sealed) {
    if (rocksdb::Status s = files.put(storage_->sealed_ledger(), {r.name.data(), r.name.size()},
                                      std::string_view(sealed_values).substr(r.at, r.size));
        !s.ok()) {
      return from_rocksdb(s, what);
    }
  }
  std::string index_key;
  for (const SealedRecord& r : sealed) {
    sealed_index_key_of({r.name.data(), r.name.size()}, &index_key);
    if (rocksdb::Status s = files.put(storage_->sealed_index(), index_key, ""); !s.ok()) return from_rocksdb(s, what);
  }
  if (!created.empty()) {
    // A key stored without the batch (which then failed) is found and used
    // by the next one.
    if (Status s = store_user_keys(*storage_, created,
                                   what + ": the ledger keys of " + std::to_string(created.size()) +
                                       " users new to the ledger");
        !s.ok()) {
      return s;
    }
    for (const auto& [user, k] : created) revoked_keys_.erase(user);
  }
  ChangeFeed::Appended appended;
  if (feed_done.valid()) {
    Result<ChangeFeed::Appended> a = feed_done.get();
    if (!a.ok()) return a.status();
    appended = *a;
  }
  Storage::test_step("aggregate write", 1);  // built, not yet ingested
  store->lock();  // a write beside this batch (exclusive_for) lands before it
  if (Status s = files.ingest(what, &feed_file); !s.ok()) return s;
  if (feed_ != nullptr) feed_->committed(appended);
  for (const auto& [user, k] : created) ledger_keys_.insert(user, k);  // stored now
  return Status::OK();
}

Result<Units> StateStore::read(AggregateKind kind, std::uint64_t owner, std::uint64_t item) const {
  const std::string key = encode_aggregate_key(kind, owner, item);
  const Cell cell{static_cast<std::uint8_t>(kind), owner, item, 0};
  std::shared_lock<std::shared_mutex> view(view_mu_);
  Units sum = 0;
  std::string stored;
  Status s = storage_->get(storage_->aggregates(), key, &stored, frozen_live_ ? frozen_snapshot_ : nullptr);
  if (s.ok()) {
    std::optional<Units> u = decode_units(stored);
    if (!u) {
      return Status::Corruption("aggregate " + describe({kind, owner, item}) + " (key " + hex(key) + ") of '" +
                                storage_->path() + "' has a " + std::to_string(stored.size()) +
                                "-byte value; expected 16");
    }
    sum = *u;
  } else if (s.code() != StatusCode::NotFound) {
    return Status(s.code(), "read of aggregate " + describe({kind, owner, item}) + " (key " + hex(key) + "): " +
                                s.message());
  }
  const int a = active_.load(std::memory_order_acquire);
  Units pending = 0;
  if (buffers_[a].find(cell, pending)) sum += pending;
  if (frozen_live_ && buffers_[1 - a].find(cell, pending)) sum += pending;
  return sum;
}

StateStoreStats StateStore::stats() const {
  StateStoreStats out;
  out.writes = writes_.load(std::memory_order_relaxed);
  out.write_failures = write_failures_.load(std::memory_order_relaxed);
  out.cells_written = cells_written_.load(std::memory_order_relaxed);
  out.backpressure_waits = backpressure_waits_.load(std::memory_order_relaxed);
  out.pending_cells = entries_[0].load(std::memory_order_relaxed) + entries_[1].load(std::memory_order_relaxed);
  out.admission_delayed_signals = delayed_signals_.load(std::memory_order_relaxed);
  out.admission_delay_ns = delay_ns_.load(std::memory_order_relaxed);
  out.admission_delay_max_ns = delay_max_ns_.load(std::memory_order_relaxed);
  out.backpressure_wait_max_ns = backpressure_max_ns_.load(std::memory_order_relaxed);
  out.admission_refused_signals = refused_signals_.load(std::memory_order_relaxed);
  out.feed_refused_signals = feed_refused_signals_.load(std::memory_order_relaxed);
  out.admission_rate_bytes_per_s = rate_bytes_.load(std::memory_order_relaxed);
  const double signal_bytes = signal_bytes_.load(std::memory_order_relaxed);
  out.admission_signal_bytes = signal_bytes > 0 ? static_cast<std::uint64_t>(signal_bytes + 0.5) : kDefaultSignalBytes;
  out.admission_stopped = interval_ns_.load(std::memory_order_relaxed) == kStopped;
  out.compaction_debt_bytes = debt_bytes_.load(std::memory_order_relaxed);
  out.compaction_debt_l0_files = debt_l0_files_.load(std::memory_order_relaxed);
  std::vector<std::uint64_t> recent;
  {
    std::lock_guard<std::mutex> lock(write_times_mu_);
    out.write_max_ns = write_max_ns_;
    recent = recent_writes_;
  }
  if (!recent.empty()) {
    const std::size_t rank = (recent.size() * 99 + 99) / 100 - 1;  // the smallest time >= 99 % of them
    std::nth_element(recent.begin(), recent.begin() + static_cast<std::ptrdiff_t>(rank), recent.end());
    out.write_p99_ns = recent[rank];
  }
  // A batch the writer has not stored by its deadline is a write already
  // that long.
  const std::int64_t due = writer_due_ns_.load(std::memory_order_relaxed);
  const std::int64_t now = steady_ns(std::chrono::steady_clock::now());
  if (due != 0 && now > due) out.write_max_ns = std::max(out.write_max_ns, static_cast<std::uint64_t>(now - due));
  return out;
}

Status StateStore::verify(VerifyReport* report) const {
  // In bounded memory, at one snapshot (storage/ledger_scan.h); what an
  // attempt a purge made start over found is dropped.
  LedgerCheck check;
  const std::size_t before = report->problems.size();
  Status s = check_ledger(
      *storage_, &check, [&](std::string problem) { report->problems.push_back(std::move(problem)); },
      [&](const AggregateMismatch& m) { report->problems.push_back(m.what); },
      [&] { report->problems.resize(before); });
  report->records_checked += check.ledger_records + check.aggregates;
  return s;
}

Status StateStore::exclusive(const std::function<Status()>& fn) { return exclusive_for({}, fn); }

Status StateStore::exclusive_for(std::span<const std::uint64_t> leavers, const std::function<Status()>& fn) {
  if (!leavers.empty() && feed_ == nullptr) {
    std::unique_lock<std::mutex> store(store_mu_);
    // Under store_mu_, stored_through_ holds still, and the batch that set
    // it pruned the leavers it covers.
    const bool pending = [&] {
      std::lock_guard<std::mutex> lock(leavers_mu_);
      return std::any_of(leavers.begin(), leavers.end(), [&](std::uint64_t u) {
        const auto it = leavers_.find(u);
        return it != leavers_.end() && it->second > stored_through_;
      });
    }();
    if (!pending) {
      Status s = fn();
      refresh_frozen_snapshot();
      return s;
    }
  }
  const auto due = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> drain(drain_mu_);
  if (Status s = drain_all_locked(due); !s.ok()) return s;
  std::lock_guard<std::mutex> store(store_mu_);
  return fn();
}

void StateStore::refresh_frozen_snapshot() {
  std::unique_lock<std::shared_mutex> view(view_mu_);
  if (!frozen_live_) return;
  rocksdb::DB* db = storage_->db(Storage::Engine::State);
  db->ReleaseSnapshot(frozen_snapshot_);
  frozen_snapshot_ = db->GetSnapshot();
}

void StateStore::forget_key(std::uint64_t user, bool revoke) {
  std::lock_guard<std::mutex> lock(forgotten_mu_);
  forgotten_.emplace_back(user, revoke);
}

void StateStore::note_leave(std::uint64_t user, std::uint64_t buffer) {
  std::lock_guard<std::mutex> lock(leavers_mu_);
  leavers_.insert_or_assign(user, buffer);
}

Status StateStore::between_batches(const std::function<Status()>& fn) {
  std::lock_guard<std::mutex> drain(drain_mu_);
  std::lock_guard<std::mutex> store(store_mu_);
  return fn();
}

}  // namespace tidal
