#include "feed/change_feed.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <random>
#include <string_view>

#include "storage/numbered_log.h"

namespace tidal {

namespace {

// 16 random bytes from the OS's random source.
std::string new_incarnation() {
  std::random_device rd;
  std::string out;
  while (out.size() < kIncarnationBytes) {
    const std::uint32_t r = rd();
    for (int i = 0; i < 4 && out.size() < kIncarnationBytes; ++i) out.push_back(static_cast<char>((r >> (8 * i)) & 0xff));
  }
  return out;
}

// The ordinal of a new incarnation: above `previous` (the feed's last; 0
// for none) and at least the wall clock in ns, so that a Db restored from
// an older copy, which does not know the ordinals its lost original issued
// since, still makes one above them (ChangeBatch::incarnation_ordinal).
std::uint64_t new_ordinal(std::uint64_t previous) {
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::system_clock::now().time_since_epoch()).count();
  return std::max(previous + 1, now > 0 ? static_cast<std::uint64_t>(now) : std::uint64_t{0});
}

// The feed_incarnation_ordinal record: the incarnation's 16 bytes, then its ordinal [8 BE].
std::string ordinal_record(const std::string& incarnation, std::uint64_t ordinal) {
  std::string out = incarnation;
  put_u64_be(&out, ordinal);
  return out;
}

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

std::string be64(std::uint64_t v) {
  std::string out;
  put_u64_be(&out, v);
  return out;
}

// The feed's records (storage/numbered_log.h).
NumberedLog feed_log(const Storage& storage) {
  return {&storage, "change feed", "trim record", encode_feed_key, decode_feed_key};
}

}  // namespace

Result<std::optional<std::uint64_t>> ChangeFeed::stored_shard(const Storage& storage) {
  Result<std::optional<std::uint64_t>> stored = feed_log(storage).stored_shard(storage.state_meta(), kFeedShardKey);
  if (stored.ok() && *stored && storage.feed() == nullptr) {
    return Status::Corruption("the Db at '" + storage.path() + "' records a change feed but has no feed column family");
  }
  return stored;
}

// Every nonzero cohort and community aggregate, in key order, as a delta
// from 0: the seed's and a re-seed's snapshot.
Status ChangeFeed::add_shared_aggregates(const Storage& storage, Appender* to, const std::string& what) {
  auto it = storage.iterator(storage.aggregates(), /*bulk=*/true);
  const std::string first(1, static_cast<char>(AggregateKind::Cohort));
  for (it->Seek(first); it->Valid(); it->Next()) {
    std::optional<Units> units = decode_units(view(it->value()));
    if (!units) {
      return Status::Corruption(what + ": aggregate " + hex(view(it->key())) + " has a " +
                                std::to_string(it->value().size()) + "-byte value; expected 16");
    }
    if (*units != 0) to->add(view(it->key()), *units);
  }
  return from_rocksdb(it->status(), what);
}

Status ChangeFeed::check(Storage* storage, std::uint64_t shard_id) {
  Result<std::optional<std::uint64_t>> stored = stored_shard(*storage);
  if (!stored.ok()) return stored.status();
  if (Status s = feed_log(*storage).check_shard(*stored, shard_id); !s.ok() || !*stored) return s;
  ChangeFeed probe(storage, shard_id, 0);
  return probe.load();
}

Result<std::unique_ptr<ChangeFeed>> ChangeFeed::open(Storage* storage, std::uint64_t shard_id,
                                                     std::uint64_t max_bytes) {
  Result<std::optional<std::uint64_t>> stored = stored_shard(*storage);
  if (!stored.ok()) return stored.status();
  if (Status s = feed_log(*storage).check_shard(*stored, shard_id); !s.ok()) return s;
  std::unique_ptr<ChangeFeed> feed(new ChangeFeed(storage, shard_id, max_bytes));
  if (*stored) {
    if (Status s = feed->load(); !s.ok()) return s;
    if (Status s = feed->load_incarnation(); !s.ok()) return s;
    return feed;
  }
  // First open with the feed: create it and seed it with every shared
  // aggregate's current value, in one atomic step with the shard id (a crash
  // before it leaves no shard id, and the next open seeds again).
  if (Status s = storage->create_feed(); !s.ok()) return s;
  if (Status s = feed->load(); !s.ok()) return s;
  const std::string what = "seeding the change feed of '" + storage->path() + "'";
  IngestBatch batch(storage, "feed-seed");
  Appender seed(feed.get(), FeedOrigin::Seed,
                [&](const std::string& k, const std::string& v) { return batch.put(storage->feed(), k, v); });
  if (Status s = add_shared_aggregates(*storage, &seed, what); !s.ok()) return s;
  Result<Appended> appended = seed.finish();
  if (!appended.ok()) return appended.status();
  // In key order (an ingested file's): "feed_incarnation" <
  // "feed_incarnation_ordinal" < "feed_shard_id".
  const std::string incarnation = new_incarnation();
  const std::uint64_t ordinal = new_ordinal(0);
  if (Status s = from_rocksdb(batch.put(storage->state_meta(), kFeedIncarnationKey, incarnation), what); !s.ok()) {
    return s;
  }
  if (Status s = from_rocksdb(batch.put(storage->state_meta(), kFeedOrdinalKey, ordinal_record(incarnation, ordinal)),
                              what);
      !s.ok()) {
    return s;
  }
  if (Status s = from_rocksdb(batch.put(storage->state_meta(), kFeedShardKey, be64(shard_id)), what); !s.ok()) return s;
  if (Status s = batch.ingest(what); !s.ok()) return s;
  feed->incarnation_ = hex(incarnation);
  feed->incarnation_ordinal_ = ordinal;
  feed->committed(*appended);
  return feed;
}

Status ChangeFeed::load_incarnation() {
  std::string value;
  Status s = storage_->get(storage_->state_meta(), kFeedIncarnationKey, &value);
  rocksdb::WriteBatch batch;
  if (s.ok()) {
    if (value.size() != kIncarnationBytes) {
      return Status::Corruption("the change feed's incarnation record of '" + storage_->path() + "' has " +
                                std::to_string(value.size()) + " bytes; expected 16");
    }
  } else {
    if (s.code() != StatusCode::NotFound) return s;
    if (storage_->read_only()) return Status::OK();  // unknown until the next writable open
    value = new_incarnation();
    batch.Put(storage_->state_meta(), kFeedIncarnationKey, value);
  }
  // Its ordinal: the stored one when it names this incarnation; otherwise
  // (a feed made, or re-seeded, by a version before ordinals) a new one,
  // above the stored one, written at a writable open.
  std::string stored;
  s = storage_->get(storage_->state_meta(), kFeedOrdinalKey, &stored);
  if (!s.ok() && s.code() != StatusCode::NotFound) return s;
  if (s.ok() && stored.size() != kIncarnationBytes + kIncarnationOrdinalBytes) {
    return Status::Corruption("the change feed's incarnation ordinal record of '" + storage_->path() + "' has " +
                              std::to_string(stored.size()) + " bytes; expected 24");
  }
  const std::uint64_t previous = s.ok() ? get_u64_be(stored.data() + kIncarnationBytes) : 0;
  incarnation_ = hex(value);
  if (s.ok() && std::string_view(stored).substr(0, kIncarnationBytes) == value) {
    incarnation_ordinal_ = previous;
    return Status::OK();
  }
  if (storage_->read_only()) return Status::OK();  // ordinal unknown until the next writable open
  const std::uint64_t ordinal = new_ordinal(previous);
  batch.Put(storage_->state_meta(), kFeedOrdinalKey, ordinal_record(value, ordinal));
  s = storage_->write(Storage::Engine::State, &batch, Storage::WriteMode::Sync,
                      "writing the change feed's incarnation of '" + storage_->path() + "'");
  if (!s.ok()) return s;
  incarnation_ordinal_ = ordinal;
  return Status::OK();
}

Status ChangeFeed::load() {
  const NumberedLog log = feed_log(*storage_);
  Result<LogPoint> trimmed = log.removed(storage_->state_meta(), kFeedTrimmedKey);
  if (!trimmed.ok()) return trimmed.status();
  auto it = storage_->iterator(storage_->feed());
  it->SeekToLast();
  if (Status s = from_rocksdb(it->status(), "reading the change feed of '" + storage_->path() + "'"); !s.ok()) {
    return s;
  }
  Result<LogPoint> end = log.end(it->Valid() ? it.get() : nullptr, *trimmed);
  if (!end.ok()) return end.status();
  std::lock_guard<std::mutex> lock(mu_);
  trimmed_through_ = trimmed->seq;
  trimmed_offset_ = trimmed->offset;
  last_seq_ = end->seq;
  end_offset_ = end->offset;
  update_full_locked();
  return Status::OK();
}

ChangeFeed::Appender::Appender(ChangeFeed* feed, FeedOrigin origin, Put put)
    : feed_(feed),
      put_(std::move(put)),
      encoder_(origin, [this](std::string payload) { on_payload(std::move(payload)); }) {
  std::lock_guard<std::mutex> lock(feed_->mu_);
  next_ = {feed_->last_seq_, feed_->end_offset_};
}

void ChangeFeed::Appender::on_payload(std::string payload) {
  if (!error_.ok()) return;
  const std::uint64_t end = next_.end_offset + payload.size();
  if (rocksdb::Status s = put_(encode_feed_key(next_.last_seq + 1), encode_log_value(end, payload)); !s.ok()) {
    error_ = from_rocksdb(s, "writing the change feed of '" + feed_->storage_->path() + "'");
    return;
  }
  ++next_.last_seq;
  next_.end_offset = end;
}

Result<ChangeFeed::Appended> ChangeFeed::Appender::finish() {
  (void)encoder_.finish();
  if (!error_.ok()) return error_;
  return next_;
}

void ChangeFeed::committed(const Appended& a) {
  std::lock_guard<std::mutex> lock(mu_);
  if (a.last_seq <= last_seq_) return;
  last_seq_ = a.last_seq;
  end_offset_ = a.end_offset;
  update_full_locked();
}

Status ChangeFeed::room() const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint64_t pending = end_offset_ - trimmed_offset_;
  if (pending < max_bytes_) return Status::OK();
  return Status::Busy("the change feed of shard " + std::to_string(shard_id_) + " in '" + storage_->path() +
                      "' holds " + std::to_string(pending) +
                      " bytes not yet trimmed, at or above Options::change_feed_max_bytes (" +
                      std::to_string(max_bytes_) + "); its consumers must trim_changes() what they have (is its "
                      "publisher running and connected?)");
}

Result<std::vector<ChangeBatch>> ChangeFeed::read(std::uint64_t after_seq, std::size_t max_bytes) const {
  // No reseed() ingests its records or changes the incarnation while the
  // read runs, so no batch is labelled with another incarnation than the
  // one it was written under (a read between a re-seed's ingestion and its
  // new incarnation labelled the snapshot's first batch with the old one).
  std::shared_lock<std::shared_mutex> no_reseed(reseed_mu_);
  std::uint64_t trimmed = 0;
  std::string incarnation;
  std::uint64_t ordinal = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    trimmed = trimmed_through_;
    incarnation = incarnation_;
    ordinal = incarnation_ordinal_;
  }
  if (after_seq < trimmed) {
    return Status::NotFound("read_changes(after " + std::to_string(after_seq) + "): the change feed of shard " +
                            std::to_string(shard_id_) + " is trimmed through seq " + std::to_string(trimmed) +
                            "; batches " + std::to_string(after_seq + 1) + ".." + std::to_string(trimmed) +
                            " are gone");
  }
  const NumberedLog log = feed_log(*storage_);
  std::vector<ChangeBatch> out;
  std::size_t bytes = 0;
  // No batch follows the last seq there can be (after_seq + 1 would wrap
  // to 0 and read the feed from its start).
  if (after_seq == std::numeric_limits<std::uint64_t>::max()) return out;
  auto it = storage_->iterator(storage_->feed());
  for (it->Seek(encode_feed_key(after_seq + 1)); it->Valid() && (out.empty() || bytes < max_bytes); it->Next()) {
    const std::uint64_t seq = after_seq + 1 + out.size();
    Result<std::string_view> payload = log.payload(*it, seq);
    if (!payload.ok()) return payload.status();
    ChangeBatch& b = out.emplace_back();
    b.shard_id = shard_id_;
    b.seq = seq;
    b.incarnation = incarnation;
    b.incarnation_ordinal = ordinal;
    b.payload.assign(*payload);
    bytes += b.payload.size();
  }
  if (Status s = from_rocksdb(it->status(), "reading the change feed of '" + storage_->path() + "'"); !s.ok()) {
    return s;
  }
  return out;
}

std::uint64_t ChangeFeed::last_seq() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_seq_;
}

Status ChangeFeed::trim(std::uint64_t through_seq) {
  std::lock_guard<std::mutex> one_trim(trim_mu_);
  std::uint64_t last = 0, trimmed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = last_seq_;
    trimmed = trimmed_through_;
  }
  if (through_seq > last) {
    return Status::InvalidArgument("trim_changes(" + std::to_string(through_seq) + "): the change feed of shard " +
                                   std::to_string(shard_id_) + " ends at seq " + std::to_string(last) +
                                   "; nothing trimmed");
  }
  if (through_seq <= trimmed) return Status::OK();
  Result<std::uint64_t> offset = feed_log(*storage_).end_offset(storage_->feed(), through_seq);
  if (!offset.ok()) return offset.status();
  rocksdb::WriteBatch batch;
  batch.DeleteRange(storage_->feed(), encode_feed_key(0), encode_feed_key(through_seq + 1));
  batch.Put(storage_->state_meta(), kFeedTrimmedKey, encode_log_point({through_seq, *offset}));
  if (Status s = storage_->write(Storage::Engine::State, &batch, Storage::WriteMode::Sync,
                                 "trim_changes(" + std::to_string(through_seq) + ") of '" + storage_->path() + "'");
      !s.ok()) {
    return s;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    trimmed_through_ = std::max(trimmed_through_, through_seq);
    trimmed_offset_ = std::max(trimmed_offset_, *offset);
    update_full_locked();
  }
  // Feed keys only grow, so every ingested feed file lands at the bottom
  // level, where no compaction by size ever reaches it, and the range
  // deletion alone would keep every file for good (400 files after 400
  // trimmed batches, issue 26 item 10). Drop the files that hold only
  // trimmed seqs: the range deletion just written covers every key of
  // them and ends past `through_seq`, so it is never among the files
  // dropped, and it keeps covering what a file that also holds later seqs
  // still has of the trimmed ones. Best effort: a failure leaves the files
  // to the next trim (which covers seqs 1.. again), and the trim is done.
  (void)storage_->drop_files_in_range(storage_->feed(), encode_feed_key(0), encode_feed_key(through_seq),
                                      "dropping the trimmed files of the change feed of '" + storage_->path() + "'");
  Storage::test_step("trim changes", static_cast<int>(through_seq));
  return Status::OK();
}

Result<std::uint64_t> ChangeFeed::reseed() {
  std::lock_guard<std::mutex> one_trim(trim_mu_);
  std::uint64_t last = 0, end = 0, previous_ordinal = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = last_seq_;
    end = end_offset_;
    previous_ordinal = incarnation_ordinal_;
  }
  const std::string what = "re-seeding the change feed of shard " + std::to_string(shard_id_) + " in '" +
                           storage_->path() + "'";
  // One ingestion: the untrimmed batches deleted, the snapshot, the new
  // incarnation and the trim point through the last batch before it. A
  // crash leaves the old feed whole or the new one.
  IngestBatch batch(storage_, "feed-reseed");
  if (Status s = from_rocksdb(batch.delete_range(storage_->feed(), encode_feed_key(0), encode_feed_key(last + 1)), what);
      !s.ok()) {
    return s;
  }
  Appender snapshot(this, FeedOrigin::Reseed,
                    [&](const std::string& k, const std::string& v) { return batch.put(storage_->feed(), k, v); });
  if (Status s = add_shared_aggregates(*storage_, &snapshot, what); !s.ok()) return s;
  Result<Appended> appended = snapshot.finish();
  if (!appended.ok()) return appended.status();
  Storage::test_step("reseed", 1);
  // In key order (an ingested file's): "feed_incarnation" <
  // "feed_incarnation_ordinal" < "feed_trimmed".
  const std::string incarnation = new_incarnation();
  const std::uint64_t ordinal = new_ordinal(previous_ordinal);
  if (Status s = from_rocksdb(batch.put(storage_->state_meta(), kFeedIncarnationKey, incarnation), what); !s.ok()) {
    return s;
  }
  if (Status s = from_rocksdb(batch.put(storage_->state_meta(), kFeedOrdinalKey, ordinal_record(incarnation, ordinal)),
                              what);
      !s.ok()) {
    return s;
  }
  if (Status s = from_rocksdb(batch.put(storage_->state_meta(), kFeedTrimmedKey, encode_log_point({last, end})), what);
      !s.ok()) {
    return s;
  }
  {
    // Readers wait from the ingestion to the new incarnation (read()).
    std::unique_lock<std::shared_mutex> no_read(reseed_mu_);
    if (Status s = batch.ingest(what); !s.ok()) return s;
    Storage::test_step("reseed", 2);
    std::lock_guard<std::mutex> lock(mu_);
    incarnation_ = hex(incarnation);
    incarnation_ordinal_ = ordinal;
    trimmed_through_ = last;
    trimmed_offset_ = end;
    last_seq_ = appended->last_seq;
    end_offset_ = appended->end_offset;
    update_full_locked();
  }
  (void)storage_->drop_files_in_range(storage_->feed(), encode_feed_key(0), encode_feed_key(last),
                                      "dropping the re-seeded files of the change feed of '" + storage_->path() + "'");
  return last + 1;
}

ChangeFeed::Stats ChangeFeed::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {shard_id_, last_seq_, trimmed_through_, end_offset_ - trimmed_offset_, incarnation_, incarnation_ordinal_};
}

}  // namespace tidal
