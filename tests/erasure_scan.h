// Physical and cryptographic erasure checks (docs/CONTRACT.md, P4;
// docs/PURGE.md, "What erased means"), of every file of a Db's two engines:
//   - format 3's ledger prefix [user_id BE][0x13] in every SST's point keys
//     and range tombstones and in every WAL's batches (and its bytes past
//     them);
//   - the user's ledger key (format 4, storage/sealed_ledger.h), as the key
//     store's SST files and WAL hold it (its wrapped key, and the key of
//     its bucket that unwraps it): the files still holding both, or the
//     bucket key's 32 bytes or the user key's in any file's raw bytes or
//     any SST's values;
//   - the user's sealed ledger records (named by the key's pseudonym) that
//     open with a key the Db's files still hold (a purge leaves the records
//     where they are: they must not open).
// Before a purge each of these finds the user's records; after it, none.
#ifndef TIDAL_TESTS_ERASURE_SCAN_H_
#define TIDAL_TESTS_ERASURE_SCAN_H_

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/options.h>
#include <rocksdb/sst_file_reader.h>
#include <rocksdb/table_properties.h>
#include <rocksdb/write_batch.h>

#include "storage/format.h"
#include "storage/sealed_ledger.h"
#include "storage/state_format.h"

namespace tidal::testing {

// True when `bytes` (a WAL's, past its last whole batch) hold the ledger
// prefix `prefix` ([user BE][0x13]) other than as the user id of an erasure
// mark's key ("erasure_pending/" + user BE), whose next byte is whatever
// follows the key in the log: the next record's checksum is 0x13 one time
// in 256 (seen once in CI, when the whole log was searched this way).
inline bool bytes_hold_prefix(std::string_view bytes, std::string_view prefix) {
  const std::string_view mark(kErasurePendingPrefix);
  for (std::size_t at = bytes.find(prefix); at != std::string::npos; at = bytes.find(prefix, at + 1)) {
    if (at < mark.size() || bytes.substr(at - mark.size(), mark.size()) != mark) return true;
  }
  return false;
}

// One operation of a write batch in a WAL.
struct WalOp {
  char kind;  // 'P' put, 'D' delete, 'M' merge, 'R' range deletion (key: its begin, value: its end)
  std::uint32_t family;
  std::uint64_t sequence;  // the batch's
  std::string key, value;
};

// The operations of the whole write batches of a RocksDB WAL (db/log_format.h:
// 32 KiB blocks of records, each a 7-byte header (11 in a recycled log) and a
// fragment of a batch). What follows the last whole batch (a torn tail, the
// preallocated zeros) ends the list; `*error` says why, when it is not the
// zeros or the end, and `*end` is the end of the last whole batch. Reading
// the records, not searching the bytes, names only what a batch holds: a
// search for a key store put ([8][user][33][0x01]...) also matched a
// batch's last deletion followed by the next record's checksum bytes.
inline std::vector<WalOp> wal_ops(const std::string& bytes, std::string* error, std::size_t* end) {
  constexpr std::size_t kBlock = 32768;
  struct Collect : rocksdb::WriteBatch::Handler {
    std::vector<WalOp>* out;
    std::uint64_t sequence = 0;
    void add(char kind, std::uint32_t family, const rocksdb::Slice& k, const rocksdb::Slice& v) {
      out->push_back({kind, family, sequence, k.ToString(), v.ToString()});
    }
    rocksdb::Status PutCF(std::uint32_t f, const rocksdb::Slice& k, const rocksdb::Slice& v) override {
      add('P', f, k, v);
      return rocksdb::Status::OK();
    }
    rocksdb::Status DeleteCF(std::uint32_t f, const rocksdb::Slice& k) override {
      add('D', f, k, {});
      return rocksdb::Status::OK();
    }
    rocksdb::Status SingleDeleteCF(std::uint32_t f, const rocksdb::Slice& k) override {
      add('D', f, k, {});
      return rocksdb::Status::OK();
    }
    rocksdb::Status MergeCF(std::uint32_t f, const rocksdb::Slice& k, const rocksdb::Slice& v) override {
      add('M', f, k, v);
      return rocksdb::Status::OK();
    }
    rocksdb::Status DeleteRangeCF(std::uint32_t f, const rocksdb::Slice& b, const rocksdb::Slice& e) override {
      add('R', f, b, e);
      return rocksdb::Status::OK();
    }
    void LogData(const rocksdb::Slice&) override {}
  } collect;
  std::vector<WalOp> out;
  collect.out = &out;
  error->clear();
  std::string batch;
  bool in_batch = false;
  const auto u16 = [&](std::size_t at) {
    return static_cast<std::size_t>(static_cast<unsigned char>(bytes[at])) |
           static_cast<std::size_t>(static_cast<unsigned char>(bytes[at + 1])) << 8;
  };
  *end = 0;
  for (std::size_t at = 0; at < bytes.size();) {
    const std::size_t block_left = kBlock - at % kBlock;
    if (block_left < 7) {  // the block's zero-filled trailer
      at += block_left;
      continue;
    }
    if (at + 7 > bytes.size()) {
      *error = "a record header cut short at byte " + std::to_string(at);
      break;
    }
    const std::size_t length = u16(at + 4);
    const int type = static_cast<unsigned char>(bytes[at + 6]);
    if (type == 0 && length == 0) break;  // preallocated space: the end
    const std::size_t header = type >= 5 && type <= 8 ? 11 : 7;
    if (at + header + length > bytes.size() || header + length > block_left) {
      *error = "a record at byte " + std::to_string(at) + " runs past its block or the file";
      break;
    }
    const std::string_view fragment(bytes.data() + at + header, length);
    at += header + length;
    const int base = header == 11 ? type - 4 : type;
    if (type == 9 || type == 10) continue;  // the log's compression or timestamp-size record
    if (base == 1 || base == 2) {
      if (in_batch) *error = "a batch with no last fragment before byte " + std::to_string(at);
      batch.assign(fragment);
      in_batch = base == 2;
    } else if ((base == 3 || base == 4) && in_batch) {
      batch.append(fragment);
      in_batch = base == 3;
    } else {
      *error = "record type " + std::to_string(type) + " out of place before byte " + std::to_string(at);
      break;
    }
    if (in_batch) continue;
    if (batch.size() < 12) {
      *error = "a " + std::to_string(batch.size()) + "-byte batch before byte " + std::to_string(at);
      break;
    }
    collect.sequence = 0;
    for (std::size_t i = 8; i-- > 0;) collect.sequence = collect.sequence << 8 | static_cast<unsigned char>(batch[i]);
    rocksdb::WriteBatch wb(batch);
    if (rocksdb::Status s = wb.Iterate(&collect); !s.ok()) {
      *error = "a batch before byte " + std::to_string(at) + " does not parse: " + s.ToString();
      break;
    }
    *end = at;
  }
  return out;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// What scan_files found. `user_keys`: the user's ledger keys the files
// hold, each as UserKey::encode() (33 bytes) then the key of the bucket
// that wrapped it (BucketKey::encode(), 37 bytes); pass them to a later
// scan, which then looks for them even where no key store record names the
// user.
struct ErasureScan {
  std::size_t ssts = 0, wals = 0, sst_keys = 0;
  std::size_t sealed_records = 0;  // the user's sealed records on disk, readable or not
  std::vector<std::string> found;
  std::vector<std::string> user_keys;
  std::vector<std::string> files;  // "name (bytes)" of every file read
  std::vector<std::string> wal_records;  // the WALs' operations on the user's key-store key; where a WAL's reading stopped
  std::string walk_error;          // why the directory walk ended early, if it did

  // For a failure message: what the scan read.
  std::string summary() const {
    std::ostringstream out;
    out << ssts << " SST files (" << sst_keys << " keys), " << wals << " WALs, " << sealed_records
        << " sealed records of the user, " << user_keys.size() << " of the user's keys; files:";
    for (const std::string& f : files) out << "\n  " << f;
    for (const std::string& r : wal_records) out << "\n  " << r;
    return out.str();
  }
};

// Calls `visit(name, entry)` for every regular file under `path`, `name`
// relative to it ("state/000012.sst"), but those of ingest/ (the files of
// batches being built: the database's own copies are what is scanned, and
// what a failed delete left there until the next open clears it). Returns
// why the walk ended early, if it did: no_such_file_or_directory when
// `path` is not there.
template <typename Visit>
std::error_code walk_files(const std::string& path, Visit visit) {
  std::error_code ec, walk_ec;
  auto walk = std::filesystem::recursive_directory_iterator(path, walk_ec);
  for (; !walk_ec && walk != std::filesystem::recursive_directory_iterator(); walk.increment(walk_ec)) {
    const std::string name = std::filesystem::relative(walk->path(), path, ec).string();
    if (name == "ingest") {
      walk.disable_recursion_pending();
      continue;
    }
    if (walk->is_regular_file(ec)) visit(name, *walk);
  }
  return walk_ec;
}

// The SST files under `path` (names relative to it), sorted; a walk that
// ended on an error says so in the list, which then differs from a whole one.
inline std::vector<std::string> sst_names(const std::string& path) {
  std::vector<std::string> out;
  const std::error_code ec = walk_files(path, [&](const std::string& name, const std::filesystem::directory_entry&) {
    if (name.ends_with(".sst")) out.push_back(name);
  });
  std::sort(out.begin(), out.end());
  if (ec && ec != std::errc::no_such_file_or_directory) out.push_back("(walk ended: " + ec.message() + ")");
  return out;
}

inline ErasureScan scan_files_once(const std::string& path, std::uint64_t user, std::vector<std::string> keys);

// A walk of the directory that ends early on an error (a directory removed
// under it) would leave files unread and a clean scan proving nothing: the
// walk is made again (up to 3 times), and one that never completes fails
// the test naming why.
inline ErasureScan scan_files(const std::string& path, std::uint64_t user, std::vector<std::string> keys = {}) {
  ErasureScan out;
  for (int attempt = 0; attempt < 3; ++attempt) {
    out = scan_files_once(path, user, keys);
    if (out.walk_error.empty()) return out;
  }
  ADD_FAILURE() << "the scan of " << path << " never read the whole directory: " << out.walk_error;
  return out;
}

// An open Db's compactions replace files while the scan reads, and a record
// moved from a file not yet read into one created after the listing would
// be missed: while SST files came or went during a scan, it is made again
// (at most 3 times in all, as under steady writers they always do), and
// what any of them found is reported (each found it after the call that
// erased, so each finding is one).
// For a count of what a scan finds before a purge; scan_files reads once
// (under steady writers every pass would be repeated).
inline ErasureScan scan_files_settled(const std::string& path, std::uint64_t user, std::vector<std::string> keys = {}) {
  ErasureScan all;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::vector<std::string> before = sst_names(path);
    ErasureScan out = scan_files(path, user, keys);
    all.ssts = std::max(all.ssts, out.ssts);
    all.wals = std::max(all.wals, out.wals);
    all.sst_keys = std::max(all.sst_keys, out.sst_keys);
    all.sealed_records = std::max(all.sealed_records, out.sealed_records);
    all.files = std::move(out.files);
    all.wal_records = std::move(out.wal_records);
    for (std::string& f : out.found) {
      if (std::find(all.found.begin(), all.found.end(), f) == all.found.end()) all.found.push_back(std::move(f));
    }
    for (std::string& k : out.user_keys) {
      if (std::find(all.user_keys.begin(), all.user_keys.end(), k) == all.user_keys.end()) all.user_keys.push_back(std::move(k));
    }
    if (sst_names(path) == before) break;
  }
  return all;
}

// A user's key and the bucket key that wrapped it, as ErasureScan::user_keys
// holds them.
inline std::string held_key_text(const UserKey& key, const BucketKey& bucket) {
  return std::string(key.encode().view()) + std::string(bucket.encode().view());
}

inline ErasureScan scan_files_once(const std::string& path, std::uint64_t user, std::vector<std::string> keys) {
  ErasureScan out;
  const std::string prefix = encode_key_prefix(EntityId(user), Tag::ContributionLedger);
  const std::string key_store_key = encode_key_store_key(user);
  struct Record {
    std::string name, key, value;
  };
  std::vector<Record> sealed;  // every sealed ledger record on disk
  std::vector<std::pair<std::string, std::string>> wrapped;  // every wrapped key on disk (key, value)
  std::vector<std::pair<std::uint16_t, BucketKey>> buckets;  // every bucket key on disk, by group
  std::vector<std::pair<std::string, std::string>> raw;  // (name, bytes) of every file but the SSTs' values
  const auto add_bucket = [&](std::string_view key, std::string_view value) {
    const std::optional<KeyBucket> bucket = KeyBucket::decode(key);
    if (!bucket) return;
    if (std::optional<BucketKey> k = BucketKey::decode(value)) buckets.emplace_back(bucket->group(), std::move(*k));
  };
  const auto add_wrapped = [&](std::string_view key, std::string_view value) {
    if (decode_key_store_key(key) && wrapped_key_generation(value)) wrapped.emplace_back(key, value);
  };
  const std::error_code walk_ec = walk_files(path, [&](const std::string& name, const std::filesystem::directory_entry& entry) {
    std::error_code ec;
    const std::uintmax_t size = entry.file_size(ec);
    out.files.push_back(name + (ec ? std::string(" (gone)") : " (" + std::to_string(size) + " bytes)"));
    if (name.ends_with(".sst")) {
      ++out.ssts;
      rocksdb::Options options;
      options.merge_operator = new_units_add_operator();
      rocksdb::SstFileReader reader(options);
      // A background flush or compaction of the open Db may be writing a new
      // file (not yet readable) or deleting an input: wait until the file is
      // whole or gone (up to 30 s: under the sanitizers RocksDB's jobs are
      // slow). What is gone holds nothing.
      rocksdb::Status opened = reader.Open(entry.path().string());
      for (int tries = 0; !opened.ok() && std::filesystem::exists(entry.path()) && tries < 3000; ++tries) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        opened = reader.Open(entry.path().string());
      }
      if (!opened.ok()) {
        if (std::filesystem::exists(entry.path())) ADD_FAILURE() << name << ": " << opened.ToString();
        return;
      }
      auto props = reader.GetTableProperties();
      const std::string family = props ? props->column_family_name : std::string();
      std::unique_ptr<rocksdb::Iterator> it(reader.NewIterator(rocksdb::ReadOptions()));
      for (it->SeekToFirst(); it->Valid(); it->Next()) {
        ++out.sst_keys;
        if (it->key().starts_with(prefix)) out.found.push_back(name + ": key " + hex(it->key().ToString()));
        if (family == "wrapped_keys") {
          add_wrapped(it->key().ToStringView(), it->value().ToStringView());
        } else if (family == "bucket_keys") {
          add_bucket(it->key().ToStringView(), it->value().ToStringView());
        } else if (family == "sealed_ledger") {
          sealed.push_back({name, it->key().ToString(), it->value().ToString()});
        }
        raw.emplace_back(name + " (a value)", it->value().ToString());
      }
      EXPECT_TRUE(it->status().ok()) << name << ": " << it->status().ToString();
      if (props && props->num_range_deletions != 0 && family == "ledger") {
        out.found.push_back(name + ": " + std::to_string(props->num_range_deletions) + " range tombstones");
      }
      raw.emplace_back(name, read_file(entry.path()));
    } else {
      std::string bytes = read_file(entry.path());
      if (name.ends_with(".log")) {
        ++out.wals;
        std::string torn;
        std::size_t whole = 0;
        const std::vector<WalOp> ops = wal_ops(bytes, &torn, &whole);
        // The ledger prefix in any key or value of the batches, or in the
        // bytes past them.
        bool holds_prefix = bytes_hold_prefix(std::string_view(bytes).substr(whole), prefix);
        for (const WalOp& op : ops) {
          holds_prefix = holds_prefix || op.key.find(prefix) != std::string::npos ||
                         op.value.find(prefix) != std::string::npos;
        }
        if (holds_prefix) out.found.push_back(name + ": WAL holds the prefix");
        // The key store's puts (users engine): a wrapped key (a 10-byte key,
        // a 67-byte value of version 3, or 66 of version 2) or a bucket key
        // (2 or 5 bytes, 37 of version 1).
        for (const WalOp& op : ops) {
          if (op.key == key_store_key) {
            out.wal_records.push_back(name + ": " + op.kind + " of the user's key-store key, sequence " +
                                      std::to_string(op.sequence) + ", column family " + std::to_string(op.family));
          }
          if (op.kind != 'P') continue;
          add_wrapped(op.key, op.value);
          add_bucket(op.key, op.value);
        }
        if (!torn.empty()) out.wal_records.push_back(name + ": read up to " + torn);
        // Past the last whole batch (a batch being written, a torn tail): a
        // search of the bytes for a put's key length, key, value length and
        // version, which may only add a key to look for.
        const std::string_view tail = std::string_view(bytes).substr(whole);
        for (std::size_t at = tail.find("\x25\x01"); at != std::string::npos; at = tail.find("\x25\x01", at + 1)) {
          if (at + 1 + kBucketValueSize > tail.size()) continue;
          for (const std::size_t key_size : {kBucketKeySize, kDeepBucketKeySize}) {
            if (at >= key_size + 1 && tail[at - key_size - 1] == static_cast<char>(key_size)) {
              add_bucket(tail.substr(at - key_size, key_size), tail.substr(at + 1, kBucketValueSize));
            }
          }
        }
        for (const std::size_t value_size : {kWrappedKeySize, kWrappedKeySizeV2}) {
          const std::string mark = {static_cast<char>(value_size), value_size == kWrappedKeySize ? '\x03' : '\x02'};
          for (std::size_t at = tail.find(mark); at != std::string::npos; at = tail.find(mark, at + 1)) {
            if (at >= 11 && tail[at - 11] == '\x0a' && at + 1 + value_size <= tail.size()) {
              add_wrapped(tail.substr(at - 10, 10), tail.substr(at + 1, value_size));
              if (tail.substr(at - 10, 10) == key_store_key) {
                out.wal_records.push_back(name + ": the user's key-store key and a wrapped key in the bytes at " +
                                          std::to_string(whole + at - 10) + ", past the last whole batch");
              }
            }
          }
        }
      }
      raw.emplace_back(name, std::move(bytes));
    }
  });
  // A directory that is not there holds nothing (a backup's staging
  // directory the backup removed, say).
  if (walk_ec == std::errc::no_such_file_or_directory) {
    out = ErasureScan();
    out.user_keys = std::move(keys);
    return out;
  }
  if (walk_ec) out.walk_error = walk_ec.message();
  // Every key the files hold: each wrapped key that a bucket key in the
  // files unwraps.
  std::vector<UserKey> held;
  std::sort(buckets.begin(), buckets.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  for (const auto& [key, value] : wrapped) {
    const std::uint64_t u = *decode_key_store_key(key);
    auto b = std::lower_bound(buckets.begin(), buckets.end(), key_bucket(u),
                              [](const auto& x, std::uint16_t bucket) { return x.first < bucket; });
    for (; b != buckets.end() && b->first == key_bucket(u); ++b) {
      if (std::optional<UserKey> k = b->second.unwrap(u, value)) {
        if (u == user) keys.push_back(held_key_text(*k, b->second));
        held.push_back(std::move(*k));
      }
    }
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  out.user_keys = keys;
  for (const std::string& k : keys) {
    const std::optional<UserKey> key = UserKey::decode(std::string_view(k).substr(0, kKeyStoreValueSize));
    const std::optional<BucketKey> bucket = BucketKey::decode(std::string_view(k).substr(kKeyStoreValueSize));
    if (!key || !bucket) {
      ADD_FAILURE() << "not a ledger key and its bucket key: " << k.size() << " bytes";
      continue;
    }
    for (const auto& [name, bytes] : raw) {
      if (bytes.find(key->bytes_for_testing()) != std::string::npos) {
        out.found.push_back(name + ": holds the user's ledger key");
      }
      if (bytes.find(bucket->bytes_for_testing()) != std::string::npos) {
        out.found.push_back(name + ": holds the bucket key (generation " + std::to_string(bucket->generation()) +
                            ") that wrapped the user's ledger key");
      }
    }
    for (const UserKey& h : held) {
      if (h.bytes_for_testing() == key->bytes_for_testing()) {
        out.found.push_back("the files hold the user's ledger key, wrapped, and the bucket key that unwraps it");
        break;
      }
    }
    std::string plain;
    for (const Record& r : sealed) {
      if (sealed_ledger_pseudonym(r.key) != key->pseudonym()) continue;
      ++out.sealed_records;
      for (const UserKey& h : held) {
        if (h.open(r.key, r.value, &plain)) {
          out.found.push_back(r.name + ": sealed ledger record " + hex(r.key) + " opens with a key the Db holds");
          break;
        }
      }
    }
  }
  return out;
}

}  // namespace tidal::testing

#endif  // TIDAL_TESTS_ERASURE_SCAN_H_
