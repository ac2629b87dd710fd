#include "storage/ledger_scan.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include <rocksdb/env.h>
#include <rocksdb/iterator.h>
#include <rocksdb/snapshot.h>

#include "storage/sealed_ledger.h"

namespace tidal {
namespace {

std::atomic<std::size_t> g_pass_cells{kLedgerPassCells};
std::atomic<std::uint64_t> g_passes{0};
std::atomic<std::uint64_t> g_runs{0};
std::atomic<std::size_t> g_peak_cells{0};

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

// An encoded aggregate key held inline: a std::string of 17 bytes (past the
// short-string buffer) would cost one more allocation per cell.
using AggregateKey = std::array<char, kAggregateKeySize>;
std::string_view view(const AggregateKey& k) { return {k.data(), k.size()}; }

std::uint64_t load_be64(const char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::little) v = __builtin_bswap64(v);
  return v;
}

// Bytewise, as RocksDB orders the keys (std::array's own < compares signed
// chars): the kind byte, then the owner and the item as big-endian words,
// which compare as the bytes do (inline: the sorts and the merge compare
// keys hundreds of millions of times).
struct KeyLess {
  bool operator()(const AggregateKey& a, const AggregateKey& b) const noexcept {
    const auto ka = static_cast<unsigned char>(a[0]), kb = static_cast<unsigned char>(b[0]);
    if (ka != kb) return ka < kb;
    const std::uint64_t oa = load_be64(a.data() + 1), ob = load_be64(b.data() + 1);
    if (oa != ob) return oa < ob;
    return load_be64(a.data() + 9) < load_be64(b.data() + 9);
  }
};

std::uint64_t mix64(std::uint64_t h) {  // MurmurHash3's finalizer
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  return h ^ (h >> 33);
}

// A multiset of sealed record names (storage/sealed_ledger.h), as a count
// and a sum of 64-bit hashes: two sets that differ in any name differ in
// the sum but for a 2^-64 chance.
struct RecordSet {
  std::uint64_t count = 0;
  std::uint64_t hash_sum = 0;
  void add(std::string_view name) {
    std::uint64_t h = 0x9e3779b97f4a7c15ULL ^ name.size();
    for (std::size_t i = 0; i + 8 <= name.size(); i += 8) h = mix64(h ^ load_be64(name.data() + i));
    ++count;
    hash_sum += h;
  }
};

// The users' keys, found by pseudonym. Pseudonyms are HMAC outputs, so
// uniform: the keys sorted by pseudonym and a directory of their top bits,
// a bucket for about every 4 keys (4 bytes a bucket), leave a few adjacent
// keys to compare. A binary search of the sorted keys (1M of them at 1M
// users) took about 10 dependent cache misses for each sealed record.
class KeysByPseudonym {
 public:
  explicit KeysByPseudonym(SecretVector<UserKey>* keys) : keys_(std::move(*keys)) {
    std::sort(keys_.begin(), keys_.end(), [](const UserKey& a, const UserKey& b) { return a.pseudonym() < b.pseudonym(); });
    bits_ = keys_.size() < 8 ? 0 : static_cast<unsigned>(std::bit_width(keys_.size() / 4));
    start_.assign((std::size_t{1} << bits_) + 1, static_cast<std::uint32_t>(keys_.size()));
    for (std::size_t i = keys_.size(); i-- > 0;) start_[bucket(keys_[i].pseudonym())] = static_cast<std::uint32_t>(i);
    // An empty bucket starts where the next one does.
    for (std::size_t b = start_.size() - 1; b-- > 0;) start_[b] = std::min(start_[b], start_[b + 1]);
  }

  // The key whose pseudonym this is; null when none is.
  const UserKey* find(std::string_view pseudonym) const {
    const std::size_t b = bucket(pseudonym);
    for (std::uint32_t i = start_[b]; i < start_[b + 1]; ++i) {
      if (keys_[i].pseudonym() == pseudonym) return &keys_[i];
    }
    return nullptr;
  }

 private:
  std::size_t bucket(std::string_view pseudonym) const {
    return bits_ == 0 ? 0 : static_cast<std::size_t>(load_be64(pseudonym.data()) >> (64 - bits_));
  }

  SecretVector<UserKey> keys_;
  unsigned bits_ = 0;
  // start_[b]: the first key of bucket b; start_[2^bits_]: the end (a
  // shard's users number far fewer than 2^32: 48 bytes of key each).
  std::vector<std::uint32_t> start_;
};

// The sums of at most `max_cells` cells, in an open-addressing hash table
// with linear probing, at most two thirds full: it grows fourfold as cells
// arrive, up to 3/2 * max_cells slots, so that a small Db's check stays
// small (hashed cells touch every page of a table). A slot is 34 bytes,
// packed: at the default cap of 2^21 cells the full table is 102 MiB (128
// MiB while its last growth copies), about what 2^20 cells in aligned
// 40-byte slots at most half full took before.
// Not a std::map: with 2^20 cells a lookup there is about 20 dependent
// loads, most of them cache misses (~0.6 us an entry, nearly all of the
// check's time); here it is one or two. The key order is made once per run
// instead, by sorting the cells in place (sort()), after which the table is
// an array of size() cells in key order until clear().
class CellSums {
 public:
  struct [[gnu::packed]] Slot {
    std::uint64_t lo, hi;  // the sum's halves
    AggregateKey key;
    bool used;
    Units sum() const { return static_cast<Units>((static_cast<UUnits>(hi) << 64) | lo); }
  };
  static_assert(sizeof(Slot) == 2 * sizeof(std::uint64_t) + kAggregateKeySize + 1);

  explicit CellSums(std::size_t max_cells) : max_cells_(max_cells), full_((3 * max_cells + 1) / 2) {
    // full_ / 4^k: the last growth too is fourfold.
    std::size_t first = full_;
    while (first > 4096) first /= 4;
    allocate(first);
  }
  ~CellSums() { std::free(slots_); }
  CellSums(const CellSums&) = delete;
  CellSums& operator=(const CellSums&) = delete;

  std::size_t size() const { return size_; }

  static std::uint64_t hash(const AggregateKey& key) {
    return mix64(load_be64(key.data() + 1) ^ mix64(load_be64(key.data() + 9) ^ static_cast<unsigned char>(key[0])));
  }
  // Starts loading the slot of `hash` (both cache lines it may span): the
  // lookups of the entries sum_ledger holds back then wait for memory
  // together, not in turn.
  void prefetch(std::uint64_t hash) const {
    const char* p = reinterpret_cast<const char*>(slots_ + home(hash));
    __builtin_prefetch(p, 1);
    __builtin_prefetch(p + sizeof(Slot) - 1, 1);
  }

  // Adds `units` to the sum of `key`, whose hash() is `hash`. False, adding
  // nothing, when the cell is new and max_cells are held.
  bool add(const AggregateKey& key, std::uint64_t hash, Units units) {
    for (std::size_t i = home(hash);; i = next(i)) {
      Slot& s = slots_[i];
      if (!s.used) {
        if (size_ >= max_cells_) return false;
        if (3 * (size_ + 1) > 2 * capacity_) {
          grow();
          return add(key, hash, units);
        }
        s = Slot{0, 0, key, true};
        ++size_;
      } else if (s.key != key) {
        continue;
      }
      // Modulo 2^128, as the merge operator adds.
      const UUnits sum = ((static_cast<UUnits>(s.hi) << 64) | s.lo) + static_cast<UUnits>(units);
      s.lo = static_cast<std::uint64_t>(sum);
      s.hi = static_cast<std::uint64_t>(sum >> 64);
      return true;
    }
  }

  // Moves the cells to the front, then sorts them by key.
  void sort() {
    std::size_t n = 0;
    for (std::size_t i = 0; n < size_ && i < capacity_; ++i) {
      if (!slots_[i].used) continue;
      // [n, i) holds no cell.
      if (i != n) {
        slots_[n] = slots_[i];
        slots_[i].used = false;
      }
      ++n;
    }
    std::sort(slots_, slots_ + size_, [](const Slot& a, const Slot& b) { return KeyLess{}(a.key, b.key); });
  }
  // Cell i in key order, after sort().
  const Slot& cell(std::size_t i) const { return slots_[i]; }
  // Empties the table, after sort().
  void clear() {
    for (std::size_t i = 0; i < size_; ++i) slots_[i].used = false;
    size_ = 0;
  }
  // Gives the table's memory back (to the system: calloc of this size maps
  // it) once the runs hold every cell; nothing may be added after.
  void release() {
    std::free(slots_);
    slots_ = nullptr;
    size_ = 0;
  }

 private:
  // Replaces slots_ only when the allocation succeeds (the old table is
  // then still the one the destructor frees).
  void allocate(std::size_t capacity) {
    // Zero bytes are empty slots.
    auto* slots = static_cast<Slot*>(std::calloc(capacity, sizeof(Slot)));
    if (slots == nullptr) throw std::bad_alloc();
    slots_ = slots;
    capacity_ = capacity;
  }
  // Four times the slots (full_ at the end): while it copies, the old table
  // is a quarter of the new one.
  void grow() {
    Slot* const old = slots_;
    const std::size_t old_capacity = capacity_;
    allocate(std::min(full_, 4 * capacity_));
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (!old[i].used) continue;
      std::size_t j = home(hash(old[i].key));
      while (slots_[j].used) j = next(j);
      slots_[j] = old[i];
    }
    std::free(old);
  }

  // The home slot of `hash`: its high bits scaled to the capacity (not
  // masked, so the capacity need not be a power of two).
  std::size_t home(std::uint64_t hash) const {
    return static_cast<std::size_t>((static_cast<UUnits>(hash) * capacity_) >> 64);
  }
  // The slot a probe looks at after slot i.
  std::size_t next(std::size_t i) const { return i + 1 == capacity_ ? 0 : i + 1; }

  // 3 * max_cells_ <= 2 * full_: a full table is at most two thirds full,
  // and so is a smaller one (add grows it first).
  const std::size_t max_cells_, full_;
  std::size_t capacity_ = 0;
  Slot* slots_ = nullptr;
  std::size_t size_ = 0;
};

// A record of a run: the key, then the sum as put_units writes it.
constexpr std::size_t kRecordSize = kAggregateKeySize + kUnitsSize;
// Bytes gathered before one append to the run file.
constexpr std::size_t kWriteBuffer = std::size_t{1} << 20;
// Bounds of a run's read buffer, in records: below the minimum a merge of
// very many runs would make a read per few records; above the maximum a
// larger buffer reads no faster.
constexpr std::size_t kMinReadRecords = 16, kMaxReadRecords = kWriteBuffer / kRecordSize;

constexpr std::string_view kTmpPrefix = "verify-tmp-";

std::string describe_key(std::string_view key) {
  std::optional<AggregateCell> cell = decode_aggregate_key(key);
  return (cell ? describe(*cell) + " " : std::string()) + "(key " + hex(key) + ")";
}

// The directories of the checks running in this process (full paths): a
// directory named with this process's pid and not in the set is stale.
std::mutex g_dirs_mu;
std::set<std::string> g_live_dirs;  // guarded by g_dirs_mu
std::atomic<std::uint64_t> g_dir_seq{0};

// Deletes a directory of runs and its files, quietly: a directory left
// behind is deleted by a later check.
void remove_dir(rocksdb::Env* env, const std::string& dir) {
  std::vector<std::string> names;
  if (env->GetChildren(dir, &names).ok()) {
    for (const std::string& name : names) {
      if (name != "." && name != "..") (void)env->DeleteFile(dir + "/" + name);
    }
  }
  (void)env->DeleteDir(dir);
}

// Deletes the directories of runs in `db_path` that no running check owns:
// those a crash left (their process is gone) and those of this process
// that are not live (a deletion that failed, or a crashed process's whose
// pid this one reuses). Another process's, while it runs, are its own: a
// read-only open may be checking the same Db (a crashed one's pid reused by
// an unrelated process only delays its deletion).
void remove_stale_dirs(rocksdb::Env* env, const std::string& db_path) {
  std::vector<std::string> names;
  if (!env->GetChildren(db_path, &names).ok()) return;
  const auto self = static_cast<unsigned long long>(::getpid());
  std::lock_guard<std::mutex> lock(g_dirs_mu);
  for (const std::string& name : names) {
    if (!name.starts_with(kTmpPrefix)) continue;
    const std::string dir = db_path + "/" + name;
    const unsigned long long pid = std::strtoull(name.c_str() + kTmpPrefix.size(), nullptr, 10);
    const bool pid_ok = pid > 0 && pid <= static_cast<unsigned long long>(std::numeric_limits<pid_t>::max());
    const bool running = pid == self ? g_live_dirs.count(dir) != 0
                                     : pid_ok && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
    if (!running) remove_dir(env, dir);
  }
}

// The sorted runs of one check, in one file of a directory of their own,
// both deleted when it is destroyed. Written first (spill), then read back
// once, merged (start, next).
class Runs {
 public:
  Runs(rocksdb::Env* env, const std::string& db_path, std::size_t max_cells)
      : env_(env), db_path_(db_path), max_cells_(max_cells) {}
  ~Runs() {
    writer_.reset();
    reader_.reset();
    if (dir_.empty()) return;
    std::lock_guard<std::mutex> lock(g_dirs_mu);
    remove_dir(env_, dir_);
    g_live_dirs.erase(dir_);
  }
  Runs(const Runs&) = delete;
  Runs& operator=(const Runs&) = delete;

  std::size_t count() const { return ends_.size(); }

  // Appends the cells of `sums` as one run, and empties it.
  Status spill(CellSums* sums) {
    if (writer_ == nullptr) {
      if (Status s = create(); !s.ok()) return s;
    }
    sums->sort();
    std::string buffer;
    buffer.reserve(std::min(kWriteBuffer, sums->size() * kRecordSize) + kRecordSize);
    for (std::size_t i = 0; i < sums->size(); ++i) {
      const CellSums::Slot& cell = sums->cell(i);
      buffer.append(cell.key.data(), cell.key.size());
      put_units(&buffer, cell.sum());
      if (buffer.size() >= kWriteBuffer) {
        if (Status s = append(&buffer); !s.ok()) return s;
      }
    }
    if (Status s = append(&buffer); !s.ok()) return s;
    ends_.push_back(written_);
    sums->clear();
    return Status::OK();
  }

  // Closes the file for writing and positions the merge at the first cell.
  Status start() {
    if (Status s = from_rocksdb(writer_->Close(), "closing " + file_); !s.ok()) return s;
    writer_.reset();
    if (Status s = from_rocksdb(env_->NewRandomAccessFile(file_, &reader_, rocksdb::EnvOptions()), "opening " + file_);
        !s.ok()) {
      return s;
    }
    // The read buffers share about max_cells records.
    const std::size_t records = std::clamp(max_cells_ / ends_.size(), kMinReadRecords, kMaxReadRecords);
    cursors_.resize(ends_.size());
    for (std::size_t i = 0; i < ends_.size(); ++i) {
      Cursor& c = cursors_[i];
      c.pos = i == 0 ? 0 : ends_[i - 1];
      c.end = ends_[i];
      c.buffer.reset(new char[records * kRecordSize]);
      c.capacity = records * kRecordSize;
      bool more = false;
      if (Status s = advance(&c, &more); !s.ok()) return s;
      if (more) heap_.push_back(i);
    }
    std::make_heap(heap_.begin(), heap_.end(), Later{&cursors_});
    return next();
  }

  // The cell at the merge's position, while valid().
  bool valid() const { return valid_; }
  const AggregateKey& key() const { return key_; }
  Units sum() const { return sum_; }

  // Moves to the next cell: the smallest key of any run, summed over the
  // runs that hold it.
  Status next() {
    valid_ = !heap_.empty();
    if (!valid_) return Status::OK();
    const Later later{&cursors_};
    key_ = cursors_[heap_.front()].key;
    sum_ = 0;
    while (!heap_.empty() && cursors_[heap_.front()].key == key_) {
      std::pop_heap(heap_.begin(), heap_.end(), later);
      Cursor& c = cursors_[heap_.back()];
      sum_ += c.sum;
      bool more = false;
      if (Status s = advance(&c, &more); !s.ok()) return s;
      if (more) {
        std::push_heap(heap_.begin(), heap_.end(), later);
      } else {
        heap_.pop_back();
      }
    }
    return Status::OK();
  }

 private:
  // One run being read: its next record is key, sum.
  struct Cursor {
    std::uint64_t pos = 0, end = 0;  // of what is not yet in the buffer
    std::unique_ptr<char[]> buffer;
    std::size_t capacity = 0, at = 0, size = 0;
    AggregateKey key{};
    Units sum = 0;
  };
  // Orders the heap's run numbers so that the smallest next key is on top.
  struct Later {
    const std::vector<Cursor>* cursors;
    bool operator()(std::size_t a, std::size_t b) const { return KeyLess{}((*cursors)[b].key, (*cursors)[a].key); }
  };

  Status create() {
    std::lock_guard<std::mutex> lock(g_dirs_mu);
    std::string dir = db_path_ + "/";
    dir += kTmpPrefix;
    dir += std::to_string(::getpid());
    dir += "-";
    dir += std::to_string(g_dir_seq.fetch_add(1, std::memory_order_relaxed));
    // Registered first: the destructor deletes whatever part of it exists.
    dir_ = dir;
    g_live_dirs.insert(dir_);
    file_ = dir_ + "/runs";
    if (Status s = from_rocksdb(env_->CreateDirIfMissing(dir_), "creating the directory of the I1 check's runs");
        !s.ok()) {
      return s;
    }
    return from_rocksdb(env_->NewWritableFile(file_, &writer_, rocksdb::EnvOptions()), "creating " + file_);
  }

  Status append(std::string* buffer) {
    if (buffer->empty()) return Status::OK();
    if (Status s = from_rocksdb(writer_->Append(*buffer), "writing " + file_); !s.ok()) return s;
    written_ += buffer->size();
    buffer->clear();
    return Status::OK();
  }

  // Reads the next record of `c` (*more false past its last one).
  Status advance(Cursor* c, bool* more) {
    if (c->at == c->size) {
      *more = c->pos < c->end;
      if (!*more) return Status::OK();
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(c->capacity, c->end - c->pos));
      rocksdb::Slice got;
      if (Status s = from_rocksdb(reader_->Read(c->pos, n, &got, c->buffer.get()), "reading " + file_); !s.ok()) {
        return s;
      }
      if (got.size() != n) {
        return Status::IOError("reading " + file_ + ": " + std::to_string(got.size()) + " bytes at offset " +
                               std::to_string(c->pos) + " where " + std::to_string(n) + " were written");
      }
      if (got.data() != c->buffer.get()) std::memcpy(c->buffer.get(), got.data(), n);
      c->pos += n;
      c->at = 0;
      c->size = n;
    }
    const char* record = c->buffer.get() + c->at;
    std::memcpy(c->key.data(), record, c->key.size());
    c->sum = get_units(record + kAggregateKeySize);
    c->at += kRecordSize;
    *more = true;
    return Status::OK();
  }

  rocksdb::Env* const env_;
  const std::string db_path_;
  const std::size_t max_cells_;
  std::string dir_, file_;  // empty until the first run
  std::unique_ptr<rocksdb::WritableFile> writer_;
  std::unique_ptr<rocksdb::RandomAccessFile> reader_;
  std::uint64_t written_ = 0;
  std::vector<std::uint64_t> ends_;  // the end offset of each run, in the order written
  std::vector<Cursor> cursors_;
  std::vector<std::size_t> heap_;  // the runs not yet read to their end
  bool valid_ = false;
  AggregateKey key_{};
  Units sum_ = 0;
};

// Every cell's ledger total in key order: the table's cells (sorted), or
// (when any run was written) the merge of the runs.
class Cells {
 public:
  Cells(CellSums* sums, Runs* runs) : sums_(sums), runs_(runs) {}
  Status start() {
    if (runs_->count() != 0) return runs_->start();
    sums_->sort();
    return Status::OK();
  }
  bool valid() const { return runs_->count() == 0 ? at_ < sums_->size() : runs_->valid(); }
  const AggregateKey& key() const { return runs_->count() == 0 ? sums_->cell(at_).key : runs_->key(); }
  Units sum() const { return runs_->count() == 0 ? sums_->cell(at_).sum() : runs_->sum(); }
  Status next() {
    if (runs_->count() != 0) return runs_->next();
    ++at_;
    return Status::OK();
  }

 private:
  CellSums* sums_;
  Runs* runs_;
  std::size_t at_ = 0;
};

// One attempt's hold on its snapshot and the files its iterators pin:
// counts the records read into the Storage's progress (every kStep of them)
// and notices when a purge's erasure asks scans to let go
// (Storage::ask_scans_to_let_go), after which step() is false and the
// attempt must end. The generation is read before the snapshot is taken: a
// request made after the snapshot was taken is always noticed. One that
// does not let go counts in Storage::scans_holding() for its life instead,
// from before its snapshot is taken (the reclaim of purged sealed records
// drops nothing while it is counted: storage.cc, SealedRecordReclaim).
class Hold {
 public:
  static constexpr std::uint64_t kStep = 1024;
  Hold(const Storage& storage, bool let_go)
      : storage_(storage),
        let_go_(let_go),
        generation_(storage.scan_generation()),
        holding_(storage, !let_go),
        snapshots_(storage) {}
  ~Hold() { storage_.scan_progress().records_read.fetch_sub(counted_, std::memory_order_relaxed); }
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;

  // The state engine's snapshot, and the users engine's (its key store),
  // taken together (Storage::key_store_mu).
  const rocksdb::Snapshot* snapshot() { return snapshots_.state.snapshot(); }
  const rocksdb::Snapshot* keys_snapshot() { return snapshots_.users.snapshot(); }
  // Once per record read: false once the attempt must let go.
  bool step() {
    if (++read_ % kStep == 0) {
      storage_.scan_progress().records_read.fetch_add(kStep, std::memory_order_relaxed);
      counted_ += kStep;
      Storage::test_step("ledger check", static_cast<int>(read_ / kStep));
    }
    if (let_go_ && storage_.scan_generation() != generation_) lost_ = true;
    return !lost_;
  }
  bool lost() const { return lost_; }

 private:
  const Storage& storage_;
  const bool let_go_;
  struct Snapshots {
    explicit Snapshots(const Storage& storage)
        : lock(storage.key_store_mu()),
          state(storage.db(Storage::Engine::State)),
          users(storage.db(Storage::Engine::Users)) {
      lock.unlock();
    }
    std::shared_lock<std::shared_mutex> lock;
    rocksdb::ManagedSnapshot state, users;
  };
  // Counted in Storage::scans_holding() while alive, when `counted`.
  struct Holding {
    Holding(const Storage& s, bool c) : storage(s), counted(c) {
      if (counted) storage.scans_holding().fetch_add(1, std::memory_order_seq_cst);
    }
    ~Holding() {
      if (counted) storage.scans_holding().fetch_sub(1, std::memory_order_seq_cst);
    }
    Holding(const Holding&) = delete;
    Holding& operator=(const Holding&) = delete;
    const Storage& storage;
    const bool counted;
  };
  const std::uint64_t generation_;
  Holding holding_;  // before snapshots_: counted before they are taken
  Snapshots snapshots_;
  std::uint64_t read_ = 0;
  std::uint64_t counted_ = 0;
  bool lost_ = false;
};

// Step 1: sums the ledger entries per cell, writing the table out as a run
// whenever a new cell would not fit (and, if it ever did, at the end too:
// the merge then reads runs only). Counts the records and entries and
// reports the records that do not decode.
Status sum_ledger(const Storage& storage, Hold* hold, CellSums* sums, Runs* runs, std::size_t* peak,
                  LedgerCheck* out, const std::function<void(std::string)>& problem) {
  auto it = storage.iterator(storage.ledger(), /*bulk=*/true, hold->snapshot());
  std::string encoded;
  struct Pending {
    AggregateKey key;
    std::uint64_t hash;
    Units units;
  };
  // The entries of the last few records, their slots being loaded: the
  // lookups of kPending entries wait for memory together, not in turn (a
  // record of the demo's ledger holds 4).
  constexpr std::size_t kPending = 32;
  std::vector<Pending> pending;
  const auto add_pending = [&]() -> Status {
    for (const Pending& p : pending) {
      if (!sums->add(p.key, p.hash, p.units)) {
        *peak = std::max(*peak, sums->size());
        if (Status s = runs->spill(sums); !s.ok()) return s;
        sums->add(p.key, p.hash, p.units);
      }
    }
    pending.clear();
    return Status::OK();
  };
  pending.reserve(2 * kPending);
  const auto add_record = [&](const std::vector<LedgerEntry>& entries) -> Status {
    out->ledger_entries += entries.size();
    for (const LedgerEntry& e : entries) {
      encoded.clear();
      put_aggregate_key(&encoded, e.target, e.target_id, e.item);
      Pending& p = pending.emplace_back();
      std::memcpy(p.key.data(), encoded.data(), p.key.size());
      p.hash = CellSums::hash(p.key);
      p.units = e.units;
      sums->prefetch(p.hash);
    }
    return pending.size() >= kPending ? add_pending() : Status::OK();
  };
  // Format 3's unsealed records (what a Db wrote before its upgrade).
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (!hold->step()) return Status::OK();
    ++out->ledger_records;
    std::optional<LedgerKey> k = decode_ledger_key(view(it->key()));
    std::optional<std::vector<LedgerEntry>> entries = decode_ledger_value(view(it->value()));
    if (!k || !entries) {
      problem("ledger key " + hex(view(it->key())) + ": contribution ledger record (0x13) does not decode (" +
              std::to_string(it->value().size()) + "-byte value; expected a multiple of 33)");
      continue;
    }
    if (Status s = add_record(*entries); !s.ok()) return s;
  }
  if (Status s = from_rocksdb(it->status(), "ledger scan of '" + storage.path() + "'"); !s.ok()) return s;
  it.reset();
  // The sealed records, each opened with the key its pseudonym names.
  if (storage.sealed_ledger() != nullptr) {
    SecretVector<UserKey> keys;  // in pages left out of core dumps
    // (No key store: a read-only open of a Db whose users engine lacks it;
    // every sealed record is then a problem.)
    if (storage.keys() != nullptr && storage.bucket_keys() != nullptr) {
      // 48 bytes a user (48 MB at 1M users), held through the sealed scan:
      // reserved from RocksDB's estimate (and an eighth more), so that the
      // last doubling of a growing vector (its old and new buffers at once,
      // 1.5x the keys) does not set the check's peak.
      const std::uint64_t estimate = storage.estimate_keys(storage.keys());
      keys.reserve(static_cast<std::size_t>(estimate + estimate / 8));
    }
    auto k = storage.keys() == nullptr || storage.bucket_keys() == nullptr
                 ? std::unique_ptr<rocksdb::Iterator>(rocksdb::NewEmptyIterator())
                                       : storage.iterator(storage.keys(), /*bulk=*/true, hold->keys_snapshot());
    // The keys come group by group: each bucket's key is read (as of the
    // same snapshot) when its first user's comes, and kept while the group
    // lasts (a group holds its buckets of every depth).
    std::optional<std::uint16_t> group;
    std::map<std::string, std::optional<BucketKey>> bucket_keys;  // of the group's buckets, by key
    SecretBytes stored;  // a bucket key's value
    for (k->SeekToFirst(); k->Valid(); k->Next()) {
      if (!hold->step()) return Status::OK();
      const std::optional<std::uint64_t> user = decode_key_store_key(view(k->key()));
      if (!user) {
        problem("key store key " + hex(view(k->key())) + ": not the key of a user's ledger key (10 bytes: the "
                "user's group, then the user id)");
        continue;
      }
      const std::optional<WrappedHeader> header = wrapped_key_header(view(k->value()));
      if (!header) {
        problem("key store key " + hex(view(k->key())) + ": user " + std::to_string(*user) + "'s wrapped key (" +
                std::to_string(k->value().size()) + " bytes) is not one (expected " + std::to_string(kWrappedKeySize) +
                " bytes of version 3 or 4, or " + std::to_string(kWrappedKeySizeV2) + " of version 2)");
        continue;
      }
      if (group != key_bucket(*user)) {
        group = key_bucket(*user);
        bucket_keys.clear();
      }
      const KeyBucket bucket = KeyBucket::of(*user, header->depth);
      auto b = bucket_keys.find(bucket.key());
      if (b == bucket_keys.end()) {
        std::optional<BucketKey> bucket_key;
        Status g = storage.get(storage.bucket_keys(), bucket.key(), stored.buffer(), hold->keys_snapshot());
        if (g.ok()) bucket_key = decode_bucket_value(storage, bucket, stored.view());
        stored.clear();
        if (!g.ok() && g.code() != StatusCode::NotFound) return g;
        b = bucket_keys.emplace(bucket.key(), std::move(bucket_key)).first;
      }
      const std::optional<BucketKey>& bucket_key = b->second;
      std::optional<UserKey> key = bucket_key ? bucket_key->unwrap(*user, view(k->value())) : std::nullopt;
      if (!key) {
        problem("key store key " + hex(view(k->key())) + ": user " + std::to_string(*user) +
                "'s ledger key does not unwrap with the key of " + bucket.text() + " (" +
                (bucket_key ? "generation " + std::to_string(bucket_key->generation())
                            : std::string("none stored, or it does not decode")) +
                "; the " + std::to_string(k->value().size()) + "-byte value is of generation " +
                std::to_string(header->generation) + ")");
        continue;
      }
      keys.push_back(std::move(*key));
    }
    if (Status s = from_rocksdb(k->status(), "key store scan of '" + storage.path() + "'"); !s.ok()) return s;
    k.reset();
    const KeysByPseudonym by_pseudonym(&keys);
    RecordSet live;  // the records that open
    std::string plain;
    auto sealed = storage.iterator(storage.sealed_ledger(), /*bulk=*/true, hold->snapshot());
    for (sealed->SeekToFirst(); sealed->Valid(); sealed->Next()) {
      if (!hold->step()) return Status::OK();
      ++out->ledger_records;
      const std::string_view key = view(sealed->key());
      const std::optional<std::string_view> pseudonym = sealed_ledger_pseudonym(key);
      if (!pseudonym) {
        problem("sealed ledger key " + hex(key) + ": " + std::to_string(key.size()) + " bytes; expected " +
                std::to_string(kSealedLedgerKeySize));
        continue;
      }
      const UserKey* owner = by_pseudonym.find(*pseudonym);
      if (owner == nullptr) {
        // A purged user's (the purge erased the key): nothing can open it.
        // Had a live record lost its key, the aggregates it went into would
        // differ from the ledger's sums, and the comparison reports them.
        ++out->purged_records;
        continue;
      }
      std::optional<std::vector<LedgerEntry>> entries;
      if (!owner->open(key, view(sealed->value()), &plain) || !(entries = decode_sealed_entries(plain))) {
        problem("sealed ledger key " + hex(key) + ": the record (" + std::to_string(sealed->value().size()) +
                " bytes) does not open with its user's key, or what it holds does not decode");
        continue;
      }
      live.add(key);
      if (Status s = add_record(*entries); !s.ok()) return s;
    }
    if (Status s = from_rocksdb(sealed->status(), "sealed ledger scan of '" + storage.path() + "'"); !s.ok()) return s;
    sealed.reset();
    // The index must name exactly the records the keys open: a purge reads
    // a user's records through it, and one it does not name would outlive
    // the purge. Compared as multisets, by count and by a sum of hashes of
    // the record names (one read of the index, nothing held per record).
    if (storage.sealed_index() != nullptr) {
      RecordSet named;
      auto index = storage.iterator(storage.sealed_index(), /*bulk=*/true, hold->snapshot());
      for (index->SeekToFirst(); index->Valid(); index->Next()) {
        if (!hold->step()) return Status::OK();
        const std::optional<std::string> record = sealed_record_of(view(index->key()));
        if (!record) {
          problem("sealed index key " + hex(view(index->key())) + ": " + std::to_string(index->key().size()) +
                  " bytes; expected " + std::to_string(kSealedIndexKeySize));
          continue;
        }
        named.add(*record);
      }
      if (Status s = from_rocksdb(index->status(), "sealed index scan of '" + storage.path() + "'"); !s.ok()) {
        return s;
      }
      if (named.count != live.count || named.hash_sum != live.hash_sum) {
        problem("sealed index: it names " + std::to_string(named.count) + " records, and the users' keys open " +
                std::to_string(live.count) + (named.count == live.count ? " (other ones)" : "") +
                ": the index does not name exactly the live sealed records (a purge reads a user's records "
                "through it)");
      }
    }
  }
  if (Status s = add_pending(); !s.ok()) return s;
  *peak = std::max(*peak, sums->size());
  if (runs->count() == 0) return Status::OK();
  if (sums->size() != 0) {
    if (Status s = runs->spill(sums); !s.ok()) return s;
  }
  // The merge reads the runs only: its buffers take the table's place.
  sums->release();
  return Status::OK();
}

void report_absent(const AggregateKey& k, Units units, const std::function<void(const AggregateMismatch&)>& fn) {
  if (units == 0) return;
  const std::string key(view(k));
  fn({key, "aggregate " + describe_key(key) + ": stored 0 (absent), ledger " + units_to_string(units) + " (1e-9 units)",
      units, Units{0}});
}

// Steps 2 and 3: walks the stored aggregates beside the cells' totals.
Status compare(const Storage& storage, Hold* hold, Cells* cells, LedgerCheck* out,
               const std::function<void(const AggregateMismatch&)>& fn) {
  if (Status s = cells->start(); !s.ok()) return s;
  std::string last_key;
  auto it = storage.iterator(storage.aggregates(), /*bulk=*/true, hold->snapshot());
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (!hold->step()) return Status::OK();
    const std::string_view key = view(it->key());
    ++out->aggregates;
    last_key.assign(key);
    for (; cells->valid() && view(cells->key()) < key;) {
      report_absent(cells->key(), cells->sum(), fn);
      if (Status s = cells->next(); !s.ok()) return s;
    }
    Units recomputed = 0;
    if (cells->valid() && view(cells->key()) == key) {
      recomputed = cells->sum();
      if (Status s = cells->next(); !s.ok()) return s;
    }
    std::optional<AggregateCell> cell = decode_aggregate_key(key);
    std::optional<Units> stored = decode_units(view(it->value()));
    if (!cell || !stored) {
      fn({last_key,
          "aggregate " + describe_key(key) + " does not decode (" + std::to_string(it->value().size()) +
              "-byte value; expected 16)",
          recomputed, std::nullopt});
      continue;
    }
    if (cell->kind == AggregateKind::Personal) continue;
    if (*stored != recomputed) {
      fn({last_key,
          "aggregate " + describe_key(key) + ": stored " + units_to_string(*stored) + ", ledger " +
              units_to_string(recomputed) + " (1e-9 units)",
          recomputed, stored});
    }
  }
  if (!it->status().ok()) {
    // A merge operand of the wrong length fails the iterator itself.
    return from_rocksdb(it->status(), "aggregate scan of '" + storage.path() + "' after key " +
                                          (last_key.empty() ? std::string("(none)") : describe_key(last_key)));
  }
  // What is left has no stored aggregate.
  for (; cells->valid();) {
    report_absent(cells->key(), cells->sum(), fn);
    if (Status s = cells->next(); !s.ok()) return s;
  }
  return Status::OK();
}

}  // namespace

std::size_t ledger_pass_cells() { return g_pass_cells.load(std::memory_order_relaxed); }

void set_ledger_pass_cells(std::size_t cells) {
  g_pass_cells.store(cells == 0 ? kLedgerPassCells : cells, std::memory_order_relaxed);
}

LedgerPassTally ledger_pass_tally() {
  return {g_passes.load(std::memory_order_relaxed), g_runs.load(std::memory_order_relaxed),
          g_peak_cells.load(std::memory_order_relaxed)};
}

void reset_ledger_pass_tally() {
  g_passes.store(0, std::memory_order_relaxed);
  g_runs.store(0, std::memory_order_relaxed);
  g_peak_cells.store(0, std::memory_order_relaxed);
}

// Where a check writes its runs: the Db's directory, except for a
// read-only open, which writes nothing there (it may be a read-only file
// system, or another process's Db): the system's temporary directory.
std::string scratch_dir(const Storage& storage) {
  if (!storage.read_only()) return storage.path();
  std::error_code ec;
  const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
  return ec ? std::string("/tmp") : tmp.string();
}

Status check_ledger(const Storage& storage, LedgerCheck* out, const std::function<void(std::string)>& problem,
                    const std::function<void(const AggregateMismatch&)>& mismatch,
                    const std::function<void()>& restarted, std::size_t max_cells) {
  rocksdb::Env* env = storage.db(Storage::Engine::State)->GetEnv();
  max_cells = std::max<std::size_t>(max_cells, 1);
  const std::string scratch = scratch_dir(storage);
  remove_stale_dirs(env, scratch);
  Storage::ScanProgress& progress = storage.scan_progress();
  const std::uint64_t estimate =
      storage.estimate_keys(storage.ledger()) + storage.estimate_keys(storage.aggregates()) +
      (storage.sealed_ledger() != nullptr ? storage.estimate_keys(storage.sealed_ledger()) : 0);
  progress.records_estimate.fetch_add(estimate, std::memory_order_relaxed);
  struct Unestimate {
    Storage::ScanProgress& progress;
    std::uint64_t estimate;
    ~Unestimate() { progress.records_estimate.fetch_sub(estimate, std::memory_order_relaxed); }
  } unestimate{progress, estimate};
  for (std::uint64_t attempt = 0;; ++attempt) {
    if (attempt != 0) {
      progress.restarts.fetch_add(1, std::memory_order_relaxed);
      restarted();
    }
    *out = LedgerCheck{};
    out->restarts = attempt;
    Hold hold(storage, /*let_go=*/attempt < kLedgerCheckLetGoes);
    Runs runs(env, scratch, max_cells);
    CellSums sums(max_cells);
    std::size_t peak = 0;
    Status s = sum_ledger(storage, &hold, &sums, &runs, &peak, out, problem);
    for (std::size_t seen = g_peak_cells.load(std::memory_order_relaxed);
         peak > seen && !g_peak_cells.compare_exchange_weak(seen, peak, std::memory_order_relaxed);) {
    }
    if (s.ok() && !hold.lost()) {
      ++out->passes;
      out->runs += runs.count();
      g_passes.fetch_add(1, std::memory_order_relaxed);
      g_runs.fetch_add(runs.count(), std::memory_order_relaxed);
      Cells cells(&sums, &runs);
      s = compare(storage, &hold, &cells, out, mismatch);
    }
    if (!s.ok() || !hold.lost()) return s;
    // A purge's erasure waits for this snapshot or these files: let go of
    // both (the Hold, the runs) and start over.
  }
}

}  // namespace tidal
