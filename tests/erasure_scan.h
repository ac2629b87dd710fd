// Physical and cryptographic erasure checks (docs/CONTRACT.md, P4;
// docs/PURGE.md, "What erased means"), of every file of a Db's two engines:
//   - format 3's ledger prefix [user_id BE][0x13] in every SST's point keys
//     and range tombstones and in every WAL's raw bytes;
//   - the user's ledger key (format 4, storage/sealed_ledger.h), as the key
//     store's SST files and WAL name it: its 32 bytes in any file's raw
//     bytes or any SST's values;
//   - the user's sealed ledger records (named by the key's pseudonym) that
//     open with a key the Db's files still hold.
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

#include "storage/format.h"
#include "storage/sealed_ledger.h"
#include "storage/state_format.h"

namespace tidal::testing {

// True when `wal` holds the ledger prefix `prefix` ([user BE][0x13]) other
// than as the user id of an erasure mark's key ("erasure_pending/" + user
// BE, deleted through the WAL once the erasure is done), whose next byte is
// whatever follows the key in the log: the next record's checksum is 0x13
// one time in 256 (seen once in CI).
inline bool wal_holds_prefix(const std::string& wal, const std::string& prefix) {
  const std::string mark(kErasurePendingPrefix);
  for (std::size_t at = wal.find(prefix); at != std::string::npos; at = wal.find(prefix, at + 1)) {
    if (at < mark.size() || wal.compare(at - mark.size(), mark.size(), mark) != 0) return true;
  }
  return false;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// What scan_files found. `user_keys`: the user's ledger keys (the key
// store's value, 33 bytes) the files hold; pass them to a later scan, which
// then looks for them even where no key store record names the user.
struct ErasureScan {
  std::size_t ssts = 0, wals = 0, sst_keys = 0;
  std::size_t sealed_records = 0;  // the user's sealed records on disk, readable or not
  std::vector<std::string> found;
  std::vector<std::string> user_keys;
  std::vector<std::string> files;  // "name (bytes)" of every file read
  std::string walk_error;          // why the directory walk ended early, if it did

  // For a failure message: what the scan read.
  std::string summary() const {
    std::ostringstream out;
    out << ssts << " SST files (" << sst_keys << " keys), " << wals << " WALs, " << sealed_records
        << " sealed records of the user, " << user_keys.size() << " of the user's keys; files:";
    for (const std::string& f : files) out << "\n  " << f;
    return out.str();
  }
};

// The SST files under `path` (names relative to it), sorted; a walk that
// ended on an error says so in the list, which then differs from a whole one.
inline std::vector<std::string> sst_names(const std::string& path) {
  std::vector<std::string> out;
  std::error_code ec, walk_ec;
  auto walk = std::filesystem::recursive_directory_iterator(path, walk_ec);
  for (; !walk_ec && walk != std::filesystem::recursive_directory_iterator(); walk.increment(walk_ec)) {
    if (walk->path().extension() == ".sst") out.push_back(std::filesystem::relative(walk->path(), path, ec).string());
  }
  std::sort(out.begin(), out.end());
  if (walk_ec && walk_ec != std::errc::no_such_file_or_directory) out.push_back("(walk ended: " + walk_ec.message() + ")");
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

inline ErasureScan scan_files_once(const std::string& path, std::uint64_t user, std::vector<std::string> keys) {
  ErasureScan out;
  const std::string prefix = encode_key_prefix(EntityId(user), Tag::ContributionLedger);
  const std::string key_store_key = encode_key_store_key(user);
  struct Record {
    std::string name, key, value;
  };
  std::vector<Record> sealed;  // every sealed ledger record on disk
  std::vector<UserKey> held;   // every key the key store's files hold
  std::vector<std::pair<std::string, std::string>> raw;  // (name, bytes) of every file but the SSTs' values
  std::error_code ec, walk_ec;
  auto walk = std::filesystem::recursive_directory_iterator(path, walk_ec);
  // A directory that is not there holds nothing (a backup's staging
  // directory the backup removed, say).
  if (walk_ec == std::errc::no_such_file_or_directory) {
    out.user_keys = std::move(keys);
    return out;
  }
  for (; !walk_ec && walk != std::filesystem::recursive_directory_iterator(); walk.increment(walk_ec)) {
    const auto& entry = *walk;
    // Relative to the Db directory: "state/000012.sst".
    const std::string name = std::filesystem::relative(entry.path(), path, ec).string();
    // ingest/ holds the files of batches being built (the database's own
    // copies are what is scanned), and what a failed delete left there
    // until the next open clears it.
    if (name == "ingest") {
      walk.disable_recursion_pending();
      continue;
    }
    if (!entry.is_regular_file(ec)) continue;
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
        continue;
      }
      auto props = reader.GetTableProperties();
      const std::string family = props ? props->column_family_name : std::string();
      std::unique_ptr<rocksdb::Iterator> it(reader.NewIterator(rocksdb::ReadOptions()));
      for (it->SeekToFirst(); it->Valid(); it->Next()) {
        ++out.sst_keys;
        if (it->key().starts_with(prefix)) out.found.push_back(name + ": key " + hex(it->key().ToString()));
        if (family == "keys") {
          if (std::optional<UserKey> k = UserKey::decode(it->value().ToString())) {
            held.push_back(*k);
            if (it->key() == key_store_key) keys.push_back(it->value().ToString());
          }
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
        if (wal_holds_prefix(bytes, prefix)) out.found.push_back(name + ": WAL bytes hold the prefix");
        // The key store's puts (users engine): [key length 8][user BE]
        // [value length 33][0x01][key 32]. (A record split across two WAL
        // blocks is missed; a match that is no put only adds a key to try.)
        for (std::size_t at = bytes.find("\x21\x01"); at != std::string::npos; at = bytes.find("\x21\x01", at + 1)) {
          if (at < 9 || bytes[at - 9] != '\x08' || at + 34 > bytes.size()) continue;
          if (std::optional<UserKey> k = UserKey::decode(std::string_view(bytes).substr(at + 1, 33))) {
            held.push_back(*k);
            if (std::string_view(bytes).substr(at - 8, 8) == key_store_key) keys.push_back(bytes.substr(at + 1, 33));
          }
        }
      }
      raw.emplace_back(name, std::move(bytes));
    }
  }
  if (walk_ec) out.walk_error = walk_ec.message();
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  out.user_keys = keys;
  for (const std::string& k : keys) {
    const std::optional<UserKey> key = UserKey::decode(k);
    if (!key) {
      ADD_FAILURE() << "not a ledger key: " << k.size() << " bytes";
      continue;
    }
    const std::string_view secret = key->bytes_for_testing();
    for (const auto& [name, bytes] : raw) {
      if (bytes.find(secret) != std::string::npos) out.found.push_back(name + ": holds the user's ledger key");
    }
    std::string plain;
    for (const Record& r : sealed) {
      if (!r.key.starts_with(key->pseudonym())) continue;
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
