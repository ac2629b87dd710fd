#include "storage/numbered_log.h"

#include "storage/format.h"

namespace tidal {
namespace {

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

// A record's value starts with its 8-byte end offset.
constexpr std::size_t kOffsetSize = 8;

}  // namespace

Result<std::optional<std::uint64_t>> NumberedLog::stored_shard(rocksdb::ColumnFamilyHandle* cf,
                                                                std::string_view key) const {
  std::string value;
  Status s = storage->get(cf, key, &value);
  if (s.code() == StatusCode::NotFound) return std::optional<std::uint64_t>();
  if (!s.ok()) return s;
  if (value.size() != 8) {
    return Status::Corruption(std::string("the ") + name + "'s shard id record of '" + storage->path() + "' has " +
                              std::to_string(value.size()) + " bytes; expected 8");
  }
  return std::optional<std::uint64_t>(get_u64_be(value.data()));
}

Status NumberedLog::check_shard(std::optional<std::uint64_t> stored, std::uint64_t shard_id) const {
  if (!stored || *stored == shard_id) return Status::OK();
  return Status::InvalidArgument("cannot open tidal Db at '" + storage->path() + "' with Options::shard_id " +
                                 std::to_string(shard_id) + ": its " + name + " belongs to shard " +
                                 std::to_string(*stored) + "; nothing changed");
}

Result<LogPoint> NumberedLog::removed(rocksdb::ColumnFamilyHandle* cf, std::string_view key) const {
  std::string value;
  Status s = storage->get(cf, key, &value);
  if (s.code() == StatusCode::NotFound) return LogPoint{};
  if (!s.ok()) return s;
  if (value.size() != 16) {
    return Status::Corruption(std::string("the ") + name + "'s " + removed_name + " of '" + storage->path() +
                              "' has " + std::to_string(value.size()) + " bytes; expected 16");
  }
  return LogPoint{get_u64_be(value.data()), get_u64_be(value.data() + 8)};
}

Result<LogPoint> NumberedLog::end(const rocksdb::Iterator* last, LogPoint removed) const {
  if (last == nullptr) return removed;
  std::optional<std::uint64_t> seq = decode_key(view(last->key()));
  if (!seq || last->value().size() < kOffsetSize) {
    return Status::Corruption(std::string(name) + " record " + hex(view(last->key())) + " of '" + storage->path() +
                              "' does not decode");
  }
  if (*seq <= removed.seq) return removed;
  return LogPoint{*seq, get_u64_be(last->value().data())};
}

Result<std::string_view> NumberedLog::payload(const rocksdb::Iterator& it, std::uint64_t expected) const {
  std::optional<std::uint64_t> seq = decode_key(view(it.key()));
  if (!seq || it.value().size() < kOffsetSize || *seq != expected) {
    return Status::Corruption(std::string(name) + " record " + hex(view(it.key())) + " of '" + storage->path() +
                              "' does not decode or is out of sequence (expected seq " + std::to_string(expected) +
                              ")");
  }
  return view(it.value()).substr(kOffsetSize);
}

Result<std::uint64_t> NumberedLog::end_offset(rocksdb::ColumnFamilyHandle* cf, std::uint64_t seq) const {
  std::string value;
  if (Status s = storage->get(cf, encode_key(seq), &value); !s.ok()) return s;
  if (value.size() < kOffsetSize) {
    return Status::Corruption(std::string(name) + " record of seq " + std::to_string(seq) + " in '" +
                              storage->path() + "' does not decode");
  }
  return get_u64_be(value.data());
}

std::string encode_log_value(std::uint64_t end_offset, std::string_view payload) {
  std::string out;
  out.reserve(kOffsetSize + payload.size());
  put_u64_be(&out, end_offset);
  out.append(payload);
  return out;
}

std::string encode_log_point(LogPoint p) {
  std::string out;
  put_u64_be(&out, p.seq);
  put_u64_be(&out, p.offset);
  return out;
}

}  // namespace tidal
