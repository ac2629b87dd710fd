#include "bench_util.h"

#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "db/impl.h"
#include "storage/format.h"
#include "storage/storage.h"

namespace tidal::bench {
namespace {

std::vector<std::string>& dirs() {
  static std::vector<std::string> d;
  return d;
}

void remove_dirs() {
  for (auto& d : dirs()) std::filesystem::remove_all(d);
}

void check(const Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "bench: %s\n", s.to_string().c_str());
    std::abort();
  }
}

}  // namespace

double rss_mib() {
  long pages = 0, resident = 0;
  std::ifstream statm("/proc/self/statm");
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

double peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024;
}

std::string scratch_dir(const std::string& name) {
  const char* base = std::getenv("TIDAL_BENCH_DIR");
  std::string pattern = (base ? std::filesystem::path(base) : std::filesystem::temp_directory_path()) /
                        ("tidal-bench-" + name + "-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) std::abort();
  if (dirs().empty()) std::atexit(remove_dirs);
  dirs().push_back(pattern);
  return pattern;
}

std::unique_ptr<Db> must_open(const std::string& path, const Options& options) {
  auto db = Db::open(path, options);
  check(db.status());
  return std::move(*db);
}

rocksdb::DB* open_raw_state(const std::string& path, std::vector<rocksdb::ColumnFamilyHandle*>* handles) {
  rocksdb::Options options;
  std::vector<std::string> names = {"default", "aggregates", "ledger", "receipts"}, existing;
  if (rocksdb::DB::ListColumnFamilies(options, state_engine_dir(path), &existing).ok()) {
    for (const std::string& n : existing) {
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    }
  }
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const std::string& n : names) cfs.emplace_back(n, rocksdb::ColumnFamilyOptions());
  cfs[1].options.merge_operator = new_units_add_operator();
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, state_engine_dir(path), cfs, handles, &raw);
  if (!s.ok()) {
    std::fprintf(stderr, "open of the state engine of %s: %s\n", path.c_str(), s.ToString().c_str());
    std::abort();
  }
  return raw;
}

void bulk_load(const std::string& path, std::uint64_t leavers, std::uint64_t others) {
  must_open(path).reset();  // creates the layout and the index marker
  auto storage = Storage::open(path, Storage::Config{});
  check(storage.status());
  Storage& st = **storage;
  rocksdb::WriteBatch batch;
  auto flush_batch = [&](bool force) {
    if (batch.Count() >= 10000 || (force && batch.Count() > 0)) {
      check(st.write(Storage::Engine::Users, &batch, Storage::WriteMode::Async, "bulk load"));
      batch.Clear();
    }
  };
  const std::uint64_t at = 1'700'000'000'000'000'000ULL;
  for (std::uint64_t u = 0; u < leavers; ++u) {
    put_left(st, &batch, u, at + u);
    flush_batch(false);
  }
  for (std::uint64_t i = 0; i < others; ++i) {
    std::string suffix;
    put_u64_be(&suffix, i);
    batch.Put(st.users(), encode_key(EntityId(i % 1'000'000), static_cast<Tag>(0x05), suffix), "some other record");
    flush_batch(false);
  }
  flush_batch(true);
  check(st.close());
}

void put_left(const Storage& storage, rocksdb::WriteBatch* batch, std::uint64_t u, std::uint64_t left_at_ns) {
  auto v = serialize_membership({u, MembershipStatus::Left, left_at_ns});
  std::string ts;
  put_u64_be(&ts, left_at_ns);
  const char history = serialize_history_status(MembershipStatus::Left);
  storage.put_record(batch, EntityId(u), Tag::CommunityLeave, {}, {v.data(), v.size()});
  storage.put_record(batch, EntityId(u), Tag::CommunityLeaveHistory, ts, {&history, 1});
}

}  // namespace tidal::bench
