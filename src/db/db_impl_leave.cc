// Db::Impl: the community layer. Leave and rejoin (single and bulk), then
// the reads: status, history, gate activity, for_each_left. A leave closes
// the gate, waits out the signals that passed it, reads the clock and writes
// one atomic batch (0x11, its index copy, 0x12, the stripe's clock floor,
// and with Options::journal the journal entry). With journal_wait, the call
// then waits, holding no stripe, until the entry is confirmed replicated.
#include <algorithm>

#include "db/grace.h"
#include "db/guarded.h"
#include "db/impl.h"
#include "storage/format.h"
#include "storage/index.h"

namespace tidal {
namespace {

rocksdb::Slice slice(std::string_view s) { return {s.data(), s.size()}; }

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

std::string be64(std::uint64_t v) {
  std::string out;
  put_u64_be(&out, v);
  return out;
}

std::string user_text(std::uint64_t user_id) { return "user " + std::to_string(user_id); }

Status annotate(const Status& s, const std::string& where) { return {s.code(), where + ": " + s.message()}; }

}  // namespace

// ---- leave & rejoin: one user ----

Status Db::Impl::leave_community_layer(std::uint64_t user_id) {
  return guarded("leave_community_layer", [&]() -> Status {
    Call call(this, "leave_community_layer", /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (recovering()) return recovering_status("leave_community_layer");
    std::uint64_t seq = 0;  // the journal entry replication waits for
    if (Status written = [&]() -> Status {
          std::lock_guard<std::mutex> lock(user_lock(user_id));
          CommunityMembership current{user_id, MembershipStatus::Active, std::nullopt};
          leave_status_.find(user_id, current);
          if (current.status == MembershipStatus::Left) {
            // G7: the first left_at_ns stands, and no second entry is
            // written; a retry after NotReplicated waits for the first.
            seq = journal_retry_seq();
            return Status::OK();
          }

          // Close the gate, then wait out every signal that may have passed it
          // while open (G2). Only then read the clock: every contribution already
          // forwarded carries an earlier reading (G3).
          held_back_.erase(user_id);
          gate_.close(user_id);
          // Only sections of this user (or of an unknown one) can have seen its
          // gate open. If the barrier fails the gate stays closed (G6).
          if (Status s = grace_.synchronize(user_id); !s.ok()) return s;
          // Every contribution of the user is in the write buffers up to
          // this one: a purge drains them only until it is stored.
          state_->note_leave(user_id, state_->active_buffer());
          // On error (here: a clock that cannot issue a later time; below: the
          // write) the gate stays closed (G6) and the map keeps the last durable
          // state, so a retry writes again instead of reporting a no-op.
          const Result<std::uint64_t> left_at = clock_.now();
          if (!left_at.ok()) return annotate(left_at.status(), "leave_community_layer(" + user_text(user_id) + ")");
          const CommunityMembership left{user_id, MembershipStatus::Left, *left_at};
          if (Status s = write_membership(user_id, left, *left_at, "leave_community_layer", &seq); !s.ok()) return s;
          leave_status_.insert_or_assign(user_id, left);
          leaves_.fetch_add(1, std::memory_order_relaxed);
          return Status::OK();
        }();
        !written.ok()) {
      return written;
    }
    // Durable and in effect (G1, G2) whatever the wait returns.
    return await_replication(seq, "leave_community_layer(" + user_text(user_id) + ")");
  });
}

Status Db::Impl::rejoin_community_layer(std::uint64_t user_id) {
  return guarded("rejoin_community_layer", [&]() -> Status {
    Call call(this, "rejoin_community_layer", /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (recovering()) return recovering_status("rejoin_community_layer");
    std::uint64_t seq = 0;  // the journal entry replication waits for
    if (Status written = [&]() -> Status {
          const auto lock = lock_stripes({&user_id, 1}, /*wait_for_purges=*/true);
          CommunityMembership current{user_id, MembershipStatus::Active, std::nullopt};
          leave_status_.find(user_id, current);
          // Active and ungated: nothing to do (G7), no entry written. Active but
          // gated happens only after a failed leave; the rejoin is then
          // written, as its outcome is unknown.
          if (current.status == MembershipStatus::Active && !gate_.closed_for(user_id)) {
            seq = journal_retry_seq();
            return Status::OK();
          }
          if (Status s = check_no_unfinished_purge("rejoin_community_layer", user_id); !s.ok()) return s;

          const Result<std::uint64_t> at = clock_.now();  // on error nothing is written and the gate stays closed
          if (!at.ok()) return annotate(at.status(), "rejoin_community_layer(" + user_text(user_id) + ")");
          const CommunityMembership active{user_id, MembershipStatus::Active, current.left_at_ns};
          if (Status s = write_membership(user_id, active, *at, "rejoin_community_layer", &seq); !s.ok()) return s;
          leave_status_.insert_or_assign(user_id, active);
          gate_.open(user_id);
          rejoins_.fetch_add(1, std::memory_order_relaxed);
          return Status::OK();
        }();
        !written.ok()) {
      return written;
    }
    return await_replication(seq, "rejoin_community_layer(" + user_text(user_id) + ")");
  });
}

// ---- the journal's waits ----

Status Db::Impl::await_replication(std::uint64_t seq, const std::string& what) {
  if (!journal_ || options_.journal_wait.count() <= 0 || seq == 0) return Status::OK();
  if (journal_->wait_confirmed(seq, options_.journal_wait)) return Status::OK();
  journal_wait_timeouts_.fetch_add(1, std::memory_order_relaxed);
  const bool closing = closed_.load(std::memory_order_acquire);
  return Status::NotReplicated(
      what + ": durable and in effect on this Db ('" + storage_->path() + "'), but its journal entry (seq " +
      std::to_string(seq) + " of shard " + std::to_string(options_.shard_id) + ") was not confirmed replicated " +
      (closing ? std::string("before the Db was closed")
               : "within Options::journal_wait (" + std::to_string(options_.journal_wait.count()) + " ms)") +
      "; the journal is confirmed through seq " + std::to_string(journal_->confirmed_seq()) +
      ". A retry of the same call is safe: it writes no second leave or rejoin entry and returns OK once the entry "
      "is confirmed (is the journal's publisher running?)");
}

Result<std::uint64_t> Db::Impl::write_journaled(const Journal::Fill& fill, std::span<const JournalRecord> entries,
                                                const std::string& what) {
  if (journal_) return journal_->write(fill, entries, what);
  rocksdb::WriteBatch batch;
  fill(&batch, 0);
  if (Status s = storage_->write(Storage::Engine::Users, &batch, Storage::durable_if(options_.sync_writes), what); !s.ok()) {
    return s;
  }
  return std::uint64_t{0};
}

// ---- the batch a leave or rejoin writes ----

// One atomic WriteBatch: the 0x11 record, its index copy, the 0x12 history
// entry, the stripe's clock floor and the journal entry; fsynced when
// sync_writes.
Status Db::Impl::write_membership(std::uint64_t user_id, const CommunityMembership& m, std::uint64_t at_ns,
                                  const char* what, std::uint64_t* seq) {
  const Journal::Fill fill = [&](rocksdb::WriteBatch* batch, std::uint64_t) {
    put_membership(batch, user_id, m, at_ns);
    put_clock_floor(batch, user_id, at_ns);
  };
  const JournalRecord entry{m.status == MembershipStatus::Left ? JournalKind::Leave : JournalKind::Rejoin, user_id,
                            at_ns, m.left_at_ns.value_or(0)};
  Result<std::uint64_t> written = write_journaled(fill, {&entry, 1}, std::string(what) + "(" + user_text(user_id) + ")");
  if (!written.ok()) return written.status();
  *seq = *written;
  return Status::OK();
}

// Appends the 0x11 record, its index copy and the 0x12 history entry.
void Db::Impl::put_membership(rocksdb::WriteBatch* batch, std::uint64_t user_id, const CommunityMembership& m,
                              std::uint64_t at_ns) const {
  const auto value = serialize_membership(m);
  const char history = serialize_history_status(m.status);
  storage_->put_record(batch, EntityId(user_id), Tag::CommunityLeave, {}, {value.data(), value.size()});
  storage_->put_record(batch, EntityId(user_id), Tag::CommunityLeaveHistory, be64(at_ns), {&history, 1});
}

void Db::Impl::put_clock_floor(rocksdb::WriteBatch* batch, std::uint64_t user_id, std::uint64_t ts) {
  // One record per lock stripe: writes to it are serialized by that stripe's
  // lock, so each record only ever grows.
  batch->Put(storage_->meta(), clock_floor_stripe_key(user_id % user_locks_.size()), serialize_clock_floor(ts));
}

// ---- bulk leave & rejoin ----

namespace {

// Users per synced WriteBatch of a bulk call: the fsync is paid once per
// 10,000 users, and a batch stays near 1 MB (three records per user).
constexpr std::size_t kBulkBatchUsers = 10'000;

// "leave_community_layer of 3 users (1..7)".
std::string bulk_text(const char* what, const std::vector<std::uint64_t>& users, std::size_t begin,
                      std::size_t end) {
  return std::string(what) + " of " + std::to_string(end - begin) + " users (ids " + std::to_string(users[begin]) +
         ".." + std::to_string(users[end - 1]) + ")";
}

// The storage error, plus how far the call got. Every user not written stays
// gated (a leave) or keeps its gate closed (a rejoin): G6.
Status bulk_failure(const Status& s, const char* what, std::size_t written, std::size_t total) {
  return {s.code(), s.message() + "; " + what + ": " + std::to_string(written) + " of " + std::to_string(total) +
                        " users were written before the error; the rest stay gated, and a retry of the same "
                        "call writes only those"};
}

}  // namespace

Status Db::Impl::leave_community_layer(std::span<const std::uint64_t> user_ids) {
  return bulk("leave_community_layer", user_ids, /*leave=*/true);
}

Status Db::Impl::rejoin_community_layer(std::span<const std::uint64_t> user_ids) {
  return bulk("rejoin_community_layer", user_ids, /*leave=*/false);
}

std::vector<std::unique_lock<std::mutex>> Db::Impl::lock_stripes(std::span<const std::uint64_t> users,
                                                                 bool wait_for_purges) {
  std::vector<bool> touched(user_locks_.size(), false);
  for (std::uint64_t u : users) touched[u % user_locks_.size()] = true;
  const auto purged = [&] {  // with purging_mu_ held
    return std::any_of(users.begin(), users.end(), [&](std::uint64_t u) { return purging_.contains(u); });
  };
  for (;;) {
    std::vector<std::unique_lock<std::mutex>> locks;
    for (std::size_t i = 0; i < touched.size(); ++i) {
      if (touched[i]) locks.emplace_back(user_locks_[i]);
    }
    if (!wait_for_purges) return locks;
    std::unique_lock<std::mutex> lock(purging_mu_);
    if (!purged()) return locks;  // and none can start: a purge registers under the stripes
    locks.clear();  // wait holding no stripe: the other users of the stripes go on
    purge_ended_.wait(lock, [&] { return !purged(); });
  }
}

// A single-user call holds one stripe, and every bulk call takes its stripes
// in ascending order, so no two calls wait on each other in a cycle. The
// stripes stay locked for the whole call (a concurrent leave or rejoin of a
// listed user waits for it).
Status Db::Impl::bulk(const char* what, std::span<const std::uint64_t> user_ids, bool leave) {
  return guarded(what, [&]() -> Status {
    Call call(this, what, /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (recovering()) return recovering_status(what);
    std::vector<std::uint64_t> users(user_ids.begin(), user_ids.end());
    std::sort(users.begin(), users.end());
    users.erase(std::unique(users.begin(), users.end()), users.end());  // duplicates: G7
    std::uint64_t seq = 0;  // the last journal entry replication waits for
    {
      const auto locks = lock_stripes(users, /*wait_for_purges=*/!leave);
      if (Status s = leave ? leave_locked(users, &seq) : rejoin_locked(users, &seq); !s.ok()) return s;
    }
    return await_replication(seq, std::string(what) + " of " + std::to_string(users.size()) + " users");
  });
}

void Db::Impl::put_clock_floors(rocksdb::WriteBatch* batch, const std::vector<std::uint64_t>& floors) {
  for (std::size_t stripe = 0; stripe < floors.size(); ++stripe) {
    if (floors[stripe] != 0) put_clock_floor(batch, stripe, floors[stripe]);
  }
}

// As leave_community_layer(user) for each user, with one grace period for
// all: every gate is closed, then every signal that may have passed one is
// waited out (G2), and only then is the clock read, once per user (G3).
Status Db::Impl::leave_locked(const std::vector<std::uint64_t>& users, std::uint64_t* seq) {
  std::vector<std::uint64_t> todo;
  todo.reserve(users.size());
  for (std::uint64_t u : users) {
    CommunityMembership current{u, MembershipStatus::Active, std::nullopt};
    leave_status_.find(u, current);
    if (current.status != MembershipStatus::Left) todo.push_back(u);  // G7: the first left_at_ns stands
  }
  for (std::uint64_t u : todo) {
    held_back_.erase(u);
    gate_.close(u);
  }
  if (Status s = grace_.synchronize(std::span<const std::uint64_t>(todo)); !s.ok()) return s;  // gates stay closed
  const std::uint64_t buffer = state_->active_buffer();  // as in the single form
  for (std::uint64_t u : todo) state_->note_leave(u, buffer);
  // On error every gate stays closed (G6) and the map keeps the last durable
  // state of the users not yet written, as in the single form.
  return write_bulk(todo, MembershipStatus::Left, "leave_community_layer", seq);
}

// As rejoin_community_layer(user) for each user; a gate opens only once its
// user's batch is durable.
Status Db::Impl::rejoin_locked(const std::vector<std::uint64_t>& users, std::uint64_t* seq) {
  std::vector<std::uint64_t> todo;
  todo.reserve(users.size());
  for (std::uint64_t u : users) {
    CommunityMembership current{u, MembershipStatus::Active, std::nullopt};
    leave_status_.find(u, current);
    if (current.status == MembershipStatus::Left || gate_.closed_for(u)) todo.push_back(u);  // see the single form
  }
  for (std::uint64_t u : todo) {
    if (Status s = check_no_unfinished_purge("rejoin_community_layer", u); !s.ok()) return s;
  }
  return write_bulk(todo, MembershipStatus::Active, "rejoin_community_layer", seq);
}

// Writes `status` for every user of `todo` in synced batches of
// kBulkBatchUsers, each user with its own clock reading; a batch's users
// change in memory only once it is durable (a rejoin opens their gates then).
// A leave records its time as left_at_ns; a rejoin keeps the last one. With
// a journal each batch holds its users' entries, in user order.
Status Db::Impl::write_bulk(const std::vector<std::uint64_t>& todo, MembershipStatus status, const char* what,
                            std::uint64_t* seq) {
  const bool leave = status == MembershipStatus::Left;
  // Users already in the target state wrote no entry: a retry after
  // NotReplicated waits for what was written before it.
  *seq = journal_retry_seq();
  std::vector<CommunityMembership> written;
  std::vector<std::uint64_t> at_of;
  std::vector<JournalRecord> entries;
  for (std::size_t begin = 0; begin < todo.size(); begin += kBulkBatchUsers) {
    const std::size_t end = std::min(todo.size(), begin + kBulkBatchUsers);
    std::vector<std::uint64_t> floors(user_locks_.size(), 0);
    written.clear();
    at_of.clear();
    entries.clear();
    for (std::size_t i = begin; i < end; ++i) {
      const Result<std::uint64_t> at = clock_.now();
      if (!at.ok()) return bulk_failure(at.status(), what, begin, todo.size());
      CommunityMembership m{todo[i], status, std::nullopt};
      if (leave) {
        m.left_at_ns = *at;
      } else {
        CommunityMembership current{todo[i], MembershipStatus::Active, std::nullopt};
        leave_status_.find(todo[i], current);
        m.left_at_ns = current.left_at_ns;
      }
      written.push_back(m);
      at_of.push_back(*at);
      if (journal_) {
        entries.push_back({leave ? JournalKind::Leave : JournalKind::Rejoin, todo[i], *at, m.left_at_ns.value_or(0)});
      }
      floors[todo[i] % floors.size()] = *at;
    }
    const Journal::Fill fill = [&](rocksdb::WriteBatch* batch, std::uint64_t) {
      for (std::size_t i = 0; i < written.size(); ++i) put_membership(batch, written[i].user_id, written[i], at_of[i]);
      put_clock_floors(batch, floors);
    };
    Result<std::uint64_t> w = write_journaled(fill, entries, bulk_text(what, todo, begin, end));
    if (!w.ok()) return bulk_failure(w.status(), what, begin, todo.size());
    if (journal_) *seq = *w;
    for (const CommunityMembership& m : written) {
      leave_status_.insert_or_assign(m.user_id, m);
      if (!leave) gate_.open(m.user_id);
    }
    (leave ? leaves_ : rejoins_).fetch_add(written.size(), std::memory_order_relaxed);
  }
  return Status::OK();
}

Result<CommunityMembership> Db::Impl::community_layer_status(std::uint64_t user_id) const {
  return guarded("community_layer_status", [&]() -> Result<CommunityMembership> {
    if (closed_.load(std::memory_order_acquire)) return closed_status("community_layer_status");
    if (recovering()) return recovering_status("community_layer_status");
    CommunityMembership m{user_id, MembershipStatus::Active, std::nullopt};
    leave_status_.find(user_id, m);
    return m;
  });
}

Result<std::vector<MembershipEvent>> Db::Impl::community_layer_history(std::uint64_t user_id) const {
  return guarded("community_layer_history", [&]() -> Result<std::vector<MembershipEvent>> {
    Call call(this, "community_layer_history", /*write=*/false);
    if (!call.status().ok()) return call.status();
    if (recovering()) return recovering_status("community_layer_history");
    const std::string prefix = encode_key_prefix(EntityId(user_id), Tag::CommunityLeaveHistory);
    std::vector<MembershipEvent> events;
    auto it = storage_->iterator(storage_->users());
    for (it->Seek(slice(prefix)); it->Valid() && it->key().starts_with(slice(prefix)); it->Next()) {
      const std::string_view suffix = view(it->key()).substr(prefix.size());
      std::optional<MembershipStatus> status = deserialize_history_status(view(it->value()));
      if (suffix.size() != 8 || !status) {
        return Status::Corruption("community leave history record " + hex(view(it->key())) + " of " +
                                  user_text(user_id) + " does not decode");
      }
      events.push_back({*status, get_u64_be(suffix.data())});
    }
    if (Status s = from_rocksdb(it->status(), "history read of " + user_text(user_id)); !s.ok()) return s;
    return events;
  });
}

Result<GateActivity> Db::Impl::gate_activity(std::uint64_t user_id) const {
  return guarded("gate_activity", [&]() -> Result<GateActivity> {
    if (closed_.load(std::memory_order_acquire)) return closed_status("gate_activity");
    if (recovering()) return recovering_status("gate_activity");
    GateActivity a;
    held_back_.find(user_id, a);
    return a;
  });
}

Status Db::Impl::for_each_left(const std::function<bool(const CommunityMembership&)>& fn) const {
  return guarded("for_each_left", [&]() -> Status {
    Call call(this, "for_each_left", /*write=*/false);
    if (!call.status().ok()) return call.status();
    if (recovering()) return recovering_status("for_each_left");
    bool stopped = false;
    Status s = scan_tag(*storage_, Tag::CommunityLeave,
                        [&](std::uint64_t user, std::string_view suffix, std::string_view value) -> Status {
                          if (stopped) return Status::OK();
                          std::optional<CommunityMembership> m =
                              suffix.empty() ? deserialize_membership(user, value) : std::nullopt;
                          if (!m) {
                            return Status::Corruption("community leave record (0x11) of " + user_text(user) +
                                                      " does not decode: value " + hex(value));
                          }
                          if (m->status == MembershipStatus::Left && !fn(*m)) stopped = true;
                          return Status::OK();
                        });
    return s;
  });
}

}  // namespace tidal
