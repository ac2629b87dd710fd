#include "feed/change_feed.h"

#include <algorithm>
#include <random>
#include <string_view>

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

// Lowercase hex of raw bytes.
std::string hex_digits(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (char ch : bytes) {
    const auto c = static_cast<unsigned char>(ch);
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

}  // namespace
namespace {

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

std::string be64(std::uint64_t v) {
  std::string out;
  put_u64_be(&out, v);
  return out;
}

// A feed record's value: [end_offset: 8 BE][payload].
constexpr std::size_t kOffsetSize = 8;

}  // namespace

Result<std::optional<std::uint64_t>> ChangeFeed::stored_shard(const Storage& storage) {
  std::string value;
  Status s = storage.get(storage.state_meta(), kFeedShardKey, &value);
  if (s.code() == StatusCode::NotFound) return std::optional<std::uint64_t>();
  if (!s.ok()) return s;
  if (value.size() != 8) {
    return Status::Corruption("the change feed's shard id record of '" + storage.path() + "' has " +
                              std::to_string(value.size()) + " bytes; expected 8");
  }
  if (storage.feed() == nullptr) {
    return Status::Corruption("the Db at '" + storage.path() + "' records a change feed but has no feed column family");
  }
  return std::optional<std::uint64_t>(get_u64_be(value.data()));
}

namespace {

}  // namespace

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

namespace {

Status check_shard(const Storage& storage, std::optional<std::uint64_t> stored, std::uint64_t shard_id) {
  if (!stored || *stored == shard_id) return Status::OK();
  return Status::InvalidArgument("cannot open tidal Db at '" + storage.path() + "' with Options::shard_id " +
                                 std::to_string(shard_id) + ": its change feed belongs to shard " +
                                 std::to_string(*stored) + "; nothing changed");
}

}  // namespace

Status ChangeFeed::check(Storage* storage, std::uint64_t shard_id) {
  Result<std::optional<std::uint64_t>> stored = stored_shard(*storage);
  if (!stored.ok()) return stored.status();
  if (Status s = check_shard(*storage, *stored, shard_id); !s.ok() || !*stored) return s;
  ChangeFeed probe(storage, shard_id, 0);
  return probe.load();
}

Result<std::unique_ptr<ChangeFeed>> ChangeFeed::open(Storage* storage, std::uint64_t shard_id,
                                                     std::uint64_t max_bytes) {
  Result<std::optional<std::uint64_t>> stored = stored_shard(*storage);
  if (!stored.ok()) return stored.status();
  if (Status s = check_shard(*storage, *stored, shard_id); !s.ok()) return s;
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
  // In key order (an ingested file's): "feed_incarnation" < "feed_shard_id".
  const std::string incarnation = new_incarnation();
  if (Status s = from_rocksdb(batch.put(storage->state_meta(), kFeedIncarnationKey, incarnation), what); !s.ok()) {
    return s;
  }
  if (Status s = from_rocksdb(batch.put(storage->state_meta(), kFeedShardKey, be64(shard_id)), what); !s.ok()) return s;
  if (Status s = batch.ingest(what); !s.ok()) return s;
  feed->incarnation_ = hex_digits(incarnation);
  feed->committed(*appended);
  return feed;
}

Status ChangeFeed::load_incarnation() {
  std::string value;
  Status s = storage_->get(storage_->state_meta(), kFeedIncarnationKey, &value);
  if (s.ok()) {
    if (value.size() != kIncarnationBytes) {
      return Status::Corruption("the change feed's incarnation record of '" + storage_->path() + "' has " +
                                std::to_string(value.size()) + " bytes; expected 16");
    }
    incarnation_ = hex_digits(value);
    return Status::OK();
  }
  if (s.code() != StatusCode::NotFound) return s;
  if (storage_->read_only()) return Status::OK();  // unknown until the next writable open
  value = new_incarnation();
  rocksdb::WriteBatch batch;
  batch.Put(storage_->state_meta(), kFeedIncarnationKey, value);
  s = storage_->write(Storage::Engine::State, &batch, Storage::WriteMode::Sync,
                      "writing the change feed's incarnation of '" + storage_->path() + "'");
  if (!s.ok()) return s;
  incarnation_ = hex_digits(value);
  return Status::OK();
}

Status ChangeFeed::load() {
  std::string trimmed;
  Status s = storage_->get(storage_->state_meta(), kFeedTrimmedKey, &trimmed);
  if (s.ok()) {
    if (trimmed.size() != 16) {
      return Status::Corruption("the change feed's trim record of '" + storage_->path() + "' has " +
                                std::to_string(trimmed.size()) + " bytes; expected 16");
    }
    trimmed_through_ = get_u64_be(trimmed.data());
    trimmed_offset_ = get_u64_be(trimmed.data() + 8);
  } else if (s.code() != StatusCode::NotFound) {
    return s;
  }
  last_seq_ = trimmed_through_;
  end_offset_ = trimmed_offset_;
  auto it = storage_->iterator(storage_->feed());
  it->SeekToLast();
  if (it->Valid()) {
    std::optional<std::uint64_t> seq = decode_feed_key(view(it->key()));
    if (!seq || it->value().size() < kOffsetSize) {
      return Status::Corruption("change feed record " + hex(view(it->key())) + " of '" + storage_->path() +
                                "' does not decode");
    }
    if (*seq > last_seq_) {
      last_seq_ = *seq;
      end_offset_ = get_u64_be(it->value().data());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    update_full_locked();
  }
  return from_rocksdb(it->status(), "reading the change feed of '" + storage_->path() + "'");
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
  std::string value = be64(end);
  value += payload;
  if (rocksdb::Status s = put_(encode_feed_key(next_.last_seq + 1), value); !s.ok()) {
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
  // A reseed() between the first lock and the last replaces the records
  // and the incarnation: the read starts again, so no batch is labelled
  // with another incarnation than the one it was written under.
  for (;;) {
    std::uint64_t trimmed = 0, generation = 0;
    std::string incarnation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      trimmed = trimmed_through_;
      generation = reseeds_;
      incarnation = incarnation_;
    }
    if (after_seq < trimmed) {
      return Status::NotFound("read_changes(after " + std::to_string(after_seq) + "): the change feed of shard " +
                              std::to_string(shard_id_) + " is trimmed through seq " + std::to_string(trimmed) +
                              "; batches " + std::to_string(after_seq + 1) + ".." + std::to_string(trimmed) +
                              " are gone");
    }
    std::vector<ChangeBatch> out;
    std::size_t bytes = 0;
    auto it = storage_->iterator(storage_->feed());
    for (it->Seek(encode_feed_key(after_seq + 1)); it->Valid() && (out.empty() || bytes < max_bytes); it->Next()) {
      std::optional<std::uint64_t> seq = decode_feed_key(view(it->key()));
      if (!seq || it->value().size() < kOffsetSize || *seq != after_seq + 1 + out.size()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (reseeds_ != generation) break;  // read again
        return Status::Corruption("change feed record " + hex(view(it->key())) + " of '" + storage_->path() +
                                  "' does not decode or is out of sequence (expected seq " +
                                  std::to_string(after_seq + 1 + out.size()) + ")");
      }
      ChangeBatch& b = out.emplace_back();
      b.shard_id = shard_id_;
      b.seq = *seq;
      b.incarnation = incarnation;
      b.payload.assign(it->value().data() + kOffsetSize, it->value().size() - kOffsetSize);
      bytes += b.payload.size();
    }
    if (Status s = from_rocksdb(it->status(), "reading the change feed of '" + storage_->path() + "'"); !s.ok()) {
      return s;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (reseeds_ == generation) return out;
  }
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
  std::string value;
  if (Status s = storage_->get(storage_->feed(), encode_feed_key(through_seq), &value); !s.ok()) return s;
  if (value.size() < kOffsetSize) {
    return Status::Corruption("change feed record of seq " + std::to_string(through_seq) + " in '" +
                              storage_->path() + "' does not decode");
  }
  const std::uint64_t offset = get_u64_be(value.data());
  rocksdb::WriteBatch batch;
  batch.DeleteRange(storage_->feed(), encode_feed_key(0), encode_feed_key(through_seq + 1));
  batch.Put(storage_->state_meta(), kFeedTrimmedKey, be64(through_seq) + be64(offset));
  if (Status s = storage_->write(Storage::Engine::State, &batch, Storage::WriteMode::Sync,
                                 "trim_changes(" + std::to_string(through_seq) + ") of '" + storage_->path() + "'");
      !s.ok()) {
    return s;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    trimmed_through_ = std::max(trimmed_through_, through_seq);
    trimmed_offset_ = std::max(trimmed_offset_, offset);
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
  std::uint64_t last = 0, end = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = last_seq_;
    end = end_offset_;
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
  // In key order (an ingested file's): "feed_incarnation" < "feed_trimmed".
  const std::string incarnation = new_incarnation();
  if (Status s = from_rocksdb(batch.put(storage_->state_meta(), kFeedIncarnationKey, incarnation), what); !s.ok()) {
    return s;
  }
  if (Status s = from_rocksdb(batch.put(storage_->state_meta(), kFeedTrimmedKey, be64(last) + be64(end)), what);
      !s.ok()) {
    return s;
  }
  if (Status s = batch.ingest(what); !s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incarnation_ = hex_digits(incarnation);
    ++reseeds_;
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
  return {shard_id_, last_seq_, trimmed_through_, end_offset_ - trimmed_offset_, incarnation_};
}

}  // namespace tidal
