// tidal: an embeddable personalization database.
//
// #include <tidal/db.h> is all a host needs. A Db lives in one local
// directory (two RocksDB databases: the users engine there, the state engine
// in its state/ subdirectory; docs/FORMAT.md). Signals update the user's personal layer
// and fan out to shared cohort and community aggregates; a user can leave
// the community layer, after which none of their signals reach a shared
// aggregate until they rejoin (the "leave gate"). The guarantees G1-G8 cited
// below, and those of the aggregates, are listed with the tests that prove
// them in docs/CONTRACT.md; the bytes on disk are in docs/FORMAT.md.
//
// Durability: community memberships, leaves and rejoins are written to the
// RocksDB write-ahead log (fsynced when Options::sync_writes) before the call
// returns and are never lost (without sync_writes, a power cut may lose
// those of the last aggregate_write_period). Aggregate scores (personal, cohort, community)
// are exact sums kept in RocksDB and written behind the signal path: a
// background writer stores each signal's updates within
// Options::aggregate_write_period plus the time of one write (the longest
// one is Stats::aggregate_write_max_ns), so a crash loses at most the
// signals of that window. flush() writes them at once.
//
// Thread safety: every Db method may be called from any number of threads.
#ifndef TIDAL_DB_H_
#define TIDAL_DB_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tidal/change_batch.h"
#include "tidal/journal_entry.h"
#include "tidal/status.h"
#include "tidal/version.h"

namespace tidal {

enum class MembershipStatus : std::uint8_t { Active = 0, Left = 1 };

// A user's state in the community layer. Absent from the Db means Active
// with no leave time.
struct CommunityMembership {
  std::uint64_t user_id = 0;
  MembershipStatus status = MembershipStatus::Active;
  std::optional<std::uint64_t> left_at_ns;  // ns since Unix epoch of the last leave
};

// One entry of a user's leave history: Left = a leave, Active = a rejoin.
struct MembershipEvent {
  MembershipStatus status;
  std::uint64_t at_ns;
};

// A weight is rounded to the nearest 1e-9 when the signal is accepted; it must
// be finite and at most 1e12 in magnitude.
struct Signal {
  std::uint64_t user_id = 0;
  std::uint64_t item_id = 0;
  double weight = 1.0;
};

// What one signal may fan out to, so that the write buffers stay a memory
// bound (Options::write_buffer_bytes): a context with more cohort ids is
// refused with InvalidArgument, and join_community refuses a user's
// community past the limit. A signal then adds at most
// 1 + 2 * (kMaxCohortsPerSignal + kMaxCommunitiesPerUser) = 4,097 cells to
// the buffers (its aggregates and ledger entries).
inline constexpr std::size_t kMaxCohortsPerSignal = 1024;
inline constexpr std::size_t kMaxCommunitiesPerUser = 1024;

// The cohorts the host attributes a signal to. Each listed id receives the
// weight (an id listed twice receives it twice). At most kMaxCohortsPerSignal.
struct SignalContext {
  std::vector<std::uint64_t> cohort_ids;
};

struct SignalOutcome {
  bool personal_applied = false;           // the user's own layer was updated
  std::size_t cohorts_attributed = 0;      // cohort aggregates that received the signal
  std::size_t communities_forwarded = 0;   // community aggregates that received the signal
  bool gated = false;                      // true when the leave gate held the signal back
};

enum class ContributionTarget : std::uint8_t { Cohort, Community };

// One addition of a user's signal to a shared aggregate.
struct Contribution {
  std::uint64_t user_id;
  ContributionTarget target;
  std::uint64_t target_id;
  std::uint64_t item_id;
  double weight;
  std::uint64_t forwarded_at_ns;  // from the Db clock; < left_at_ns of any later leave
};

// Optional observer of every fan-out. Called synchronously on the signaling
// thread, possibly from several threads at once, before signal_with_context
// returns, once per addition and just after it.
//
// The callback runs inside the signal's read section, which leaves, close,
// flush, purges, re-materialization and the background writer wait out, and
// a signal that finds the write buffers full waits for that writer. So:
//   - The callback must not wait (on a lock, a condition, a future, another
//     thread's result) for a thread that is inside any call of any tidal Db:
//     that thread may be waiting for this callback.
//   - Calls the callback makes itself never wait for it. Every write of any
//     Db (join/exit, leave/rejoin in either form, purge in either form,
//     flush, close) and rematerialize_shared_aggregates (even without
//     repair: it drains the buffers) return Busy at once. Reads (status,
//     history, gate activity, communities, scores, receipts, for_each_left,
//     verify, stats) are served, or return Closed once close() has begun.
//     A nested signal_with_context is served without waiting: it never
//     slows down for the buffers' fill, and when they are full it returns
//     Busy at once (nothing applied) instead of waiting for the writer.
//   - A for_each_left callback is not a read section: from it every call is
//     served as from any thread, except close() of the same Db (Busy).
// If on_contribution throws, the exception is caught and the signal stops
// there: signal_with_context returns IOError naming the sink's exception.
// Already applied and kept: the personal layer and every addition made
// before the throw, including the one whose callback threw (each addition
// precedes its report). Not applied: the later cohorts of the context and
// every community. Stats count the signal once in `signals` (and
// `personal_updates`) and each kept addition in cohort_attributions or
// community_forwards. The sink must tolerate a later call after a throw.
class ContributionSink {
 public:
  virtual ~ContributionSink() = default;
  virtual void on_contribution(const Contribution& c) = 0;
};

enum class CorruptRecordPolicy {
  Fail,         // open fails with Corruption naming the user
  TreatAsLeft,  // the user is gated as Left (no leave time) and counted in Stats
};

struct Options {
  // Create the directory and database if missing. Default: true.
  bool create_if_missing = true;
  // fsync the WAL before a membership write (join/exit/leave/rejoin) returns. Default: true.
  // When false, a process crash still loses nothing, but a power cut may lose
  // the membership writes of the last aggregate_write_period (plus one fsync):
  // the Db fsyncs them once a period, and a purge first makes the leave it
  // relies on durable (docs/CONTRACT.md, G1 and E2).
  bool sync_writes = true;
  // What open does with an undecodable 0x11 record. Default: Fail.
  CorruptRecordPolicy corrupt_record_policy = CorruptRecordPolicy::Fail;
  // Observer of every cohort/community contribution. Default: none.
  std::shared_ptr<ContributionSink> contribution_sink;
  // Open without writing anything, even while another process holds the Db;
  // every write call returns InvalidArgument. Default: false.
  bool read_only = false;
  // Wall-clock source in ns since the Unix epoch (for tests). The Db makes
  // its readings strictly increasing, and above every time it stored or
  // handed out, across crashes too. It never wraps: a reading above 2^63-1
  // (2262-04-11) is refused, and once the Db's clock has reached that limit
  // no later time exists; a call that needs a new time then fails with
  // InvalidArgument naming the clock and the value, and changes nothing.
  // Default (empty): the system clock.
  std::function<std::uint64_t()> clock;
  // The host's key-encryption key: 32 bytes (AES-256), e.g. fetched from a
  // KMS or read from a file the host mounts outside the Db directory; called
  // once by open. When set, the key store's bucket keys are stored wrapped
  // with it, so that a copy of the Db directory alone opens no live user's
  // ledger records (docs/PURGE.md). A Db whose bucket keys are wrapped
  // refuses an open without it, or with another key, with InvalidArgument
  // naming what is missing or wrong, and changes nothing; a writable open of
  // a Db without one wraps its bucket keys with it (a read-only open of such
  // a Db is InvalidArgument). An error it returns fails the open with it.
  // Change it with Db::rotate_key_encryption_key. Default (empty): the bucket
  // keys are stored in clear beside the wrapped user keys.
  std::function<Result<std::string>()> key_encryption_key;
  // Longest a signal's aggregate updates wait in memory before the background
  // writer starts storing them: the crash window is this plus the time of
  // one write, which Stats::aggregate_write_max_ns reports. Default: 1 s.
  std::chrono::milliseconds aggregate_write_period{1000};
  // Bound on the aggregate updates held in memory (two write buffers of half
  // of it each, at ~128 bytes a cell). The writer starts early when the
  // active buffer holds 3/4 of its half; past that signals slow down (at
  // most 10 ms each, growing with the square of the fill), and past the half they wait for the writer
  // (backpressure). The fill is checked before each signal, which then adds
  // at most 4,097 cells (kMaxCohortsPerSignal): signals in flight at once
  // can pass the bound by at most that many cells each (~512 KiB a thread).
  // Default: 64 MiB.
  std::size_t write_buffer_bytes = 64 << 20;
  // RocksDB block cache shared by every column family, index and filter
  // blocks included: the memory score reads use. Default: 64 MiB.
  std::size_t block_cache_bytes = 64 << 20;

  // Keep a change feed: every change to a shared (cohort or community)
  // aggregate, as exact deltas in batches numbered 1, 2, 3, ..., written in
  // the same atomic step as the change and kept on disk until trim_changes
  // (read_changes, docs/CONTRACT.md "Change feed"). Once a Db keeps a feed,
  // every writable open must set it (else InvalidArgument). Turning it on
  // for a Db that holds shared aggregates writes their values first, as
  // batch 1.. (the seed), so a view fed from seq 1 is complete. Default: off.
  bool change_feed = false;
  // This Db's shard, carried by every batch; stored at the first open with
  // change_feed, and another id later is InvalidArgument. Default: 0.
  std::uint64_t shard_id = 0;
  // Bound on the feed's untrimmed payload bytes. While the feed holds this
  // much, signal_with_context returns Busy before it applies anything,
  // naming the bound, until the consumers trim; what was accepted before is
  // always written (at close too), and so are purges and repairs. So the
  // feed passes the bound by at most the write buffers' shared cells (the
  // payload of at most write_buffer_bytes / 2 of signals) plus the purges
  // and repairs made meanwhile. Nothing is ever dropped. Default: 1 GiB.
  std::uint64_t change_feed_max_bytes = std::uint64_t{1} << 30;

  // Keep a privacy journal: every leave, rejoin and purge as an entry
  // numbered 1, 2, 3, ... (JournalEntry, read_journal), written in the same
  // atomic, durable write as the record it journals; a purge's entry is its
  // intent, durable before the purge starts (docs/CONTRACT.md J1-J6). The
  // entries carry shard_id (the same id as the change feed's; 0 is a valid
  // id, as for the feed), stored at the first open with journal: another id
  // later is InvalidArgument. Once a Db keeps a journal, every writable open
  // must set it (else InvalidArgument). Default: off.
  bool journal = false;
  // > 0: a leave, rejoin or purge returns OK only once confirm_journal
  // covers its entry (replicated on return); after journal_wait it returns
  // StatusCode::NotReplicated: durable and in effect here, not yet confirmed
  // replicated, and a retry of the same call is safe. 0: replication is
  // asynchronous, and Stats shows the unconfirmed backlog. Needs journal.
  // Default: 0.
  std::chrono::milliseconds journal_wait{0};

  // Strict erasure: before a purge reports its erasure complete, also
  // compact, into the state engine's last level, the key ranges its batch
  // wrote: the aggregate cells the purged users touched (so that no file
  // keeps the subtraction's operands, nor any version of those cells from
  // before the purge, from which the users' per-cell sums could be read),
  // their receipts (whose sequence numbers then no longer sit beside the
  // subtraction's) and the sealed index's range deletions. Without it those
  // stay in the state engine's files until RocksDB's own compactions rewrite
  // them (docs/PURGE.md, "What an attacker holding the files can learn").
  // It costs a compaction of the aggregates over the span of the purged
  // users' cells, every level-0 file included, on top of each purge (and of
  // every range, at the next open, after a crash during an erasure):
  // docs/PURGE.md gives the measured cost. Default: off.
  bool strict_erasure = false;
};

// Counters a host would export. Each is a sum since open except users_left,
// which is the current number of Left users.
struct Stats {
  std::uint64_t signals = 0;                  // accepted signal_with_context calls
  std::uint64_t personal_updates = 0;
  std::uint64_t cohort_attributions = 0;      // cohort additions
  std::uint64_t community_forwards = 0;       // community additions
  std::uint64_t gated_cohort = 0;             // signals the gate held back from cohorts
  std::uint64_t gated_community = 0;          // signals the gate held back from communities
  std::uint64_t leaves = 0;                   // leaves that changed state
  std::uint64_t rejoins = 0;                  // rejoins that changed state
  std::uint64_t users_left = 0;               // users the gate holds back now (Left, or a leave that failed)
  std::uint64_t corrupt_records_treated_as_left = 0;  // found at open, TreatAsLeft
  std::uint64_t aggregate_writes = 0;          // batches the background writer (or flush) stored
  std::uint64_t aggregate_write_failures = 0;  // failed batch writes (kept in memory and retried)
  std::uint64_t aggregate_cells_written = 0;   // aggregate cells and ledger records stored
  std::uint64_t aggregate_cells_pending = 0;   // cells in memory now, not yet stored
  std::uint64_t backpressure_waits = 0;        // signals that waited for the writer (buffers full)
  std::uint64_t backpressure_wait_max_ns = 0;  // the longest such wait of one signal (a pause past the
                                               //   buffers' soft bound, or the wait at their hard bound)
  // How long a batch write takes, from the moment the batch was due (the
  // writer's deadline, a period after the last batch started, or a call of
  // flush) to the moment it is stored, waits for a late writer included. A
  // signal acknowledged at t is stored by t + aggregate_write_period + its
  // batch's write time: the crash window (docs/CONTRACT.md S4).
  std::uint64_t aggregate_write_max_ns = 0;    // the longest since open; a write overdue now counts as far as it got
  std::uint64_t aggregate_write_p99_ns = 0;    // p99 of the last 1,000 writes (0 before the first)
  // Admission (docs/CONTRACT.md "Admission"): while the state engine's
  // compactions are behind, signals from all threads together are held to
  // a byte rate that falls as the debt grows; past the end of the debt
  // range they are refused with Busy. The writer never holds a batch back.
  std::uint64_t admission_delayed_signals = 0;   // signals that slept to keep to the rate
  std::uint64_t admission_delay_ns = 0;          // their sleeps, in total
  std::uint64_t admission_delay_max_ns = 0;      // the longest one
  std::uint64_t admission_refused_signals = 0;   // signals refused with Busy at the hard stop
  std::uint64_t admission_rate_bytes_per_s = 0;  // the rate in force now (0: no limit, or the stop)
  std::uint64_t admission_signal_bytes = 0;      // the bytes a signal counts as against it
  bool admission_stopped = false;                // at the hard stop now: signals get Busy
  std::uint64_t compaction_debt_bytes = 0;      // the debt at the last look: bytes RocksDB estimates its
                                                //   compactions have to rewrite (aggregates and ledger)
  std::uint64_t compaction_debt_l0_files = 0;   //   and the most level-0 files of either
  // The change feed (all 0 without one):
  bool change_feed = false;                     // the Db keeps a change feed
  std::uint64_t change_feed_shard_id = 0;       // its shard
  std::uint64_t change_feed_last_seq = 0;       // the last batch written
  std::uint64_t change_feed_trimmed_seq = 0;    // trimmed through this seq
  std::uint64_t change_feed_pending_bytes = 0;  // payload bytes of the untrimmed batches
  std::uint64_t change_feed_refused_signals = 0;  // signals refused (Busy) while the feed was at its bound
  std::string change_feed_incarnation;          // 32 hex digits, new at each re-seed (and restore)
  std::uint64_t change_feed_incarnation_ordinal = 0;  // its ChangeBatch::incarnation_ordinal, above every earlier
                                                //   one's (0: unknown, a read-only open of an older feed)
  bool recovering = false;                      // opened from a backup, finish_recovery() not yet called
  // The privacy journal (all 0 without one): what is not yet confirmed
  // replicated is last_seq - confirmed_seq entries of pending_bytes.
  bool journal = false;                         // the Db keeps a privacy journal
  std::uint64_t journal_shard_id = 0;           // its shard
  std::uint64_t journal_last_seq = 0;           // the last entry written
  std::uint64_t journal_confirmed_seq = 0;      // confirm_journal reached this seq
  std::uint64_t journal_pending_entries = 0;    // entries written and not yet confirmed
  std::uint64_t journal_pending_bytes = 0;      // their payload bytes
  std::uint64_t journal_wait_timeouts = 0;      // calls that returned NotReplicated (journal_wait)
  // The ledger checks of verify() and rematerialize_shared_aggregates()
  // under way: their progress, and how often a purge made one start over.
  std::uint64_t ledger_check_records_read = 0;      // records they have read (ledger, then aggregates); 0: none runs
  std::uint64_t ledger_check_records_estimate = 0;  // what they read in all, by RocksDB's estimate of the keys
  std::uint64_t ledger_check_restarts = 0;  // since open: checks that let go of their snapshot for a purge's
                                            // erasure and started over
};

// What the gate held back for one user since their last leave (in memory only).
struct GateActivity {
  std::uint64_t held_back_signals = 0;
  std::optional<std::uint64_t> last_held_back_ns;
};

// The outcome of Db::verify().
struct VerifyReport {
  std::uint64_t records_checked = 0;
  std::vector<std::string> problems;  // one line per problem, naming the key in hex
  bool ok() const { return problems.empty(); }
};

// What purge_community_contributions removed (docs/CONTRACT.md, P1-P7); kept durably under
// the user (tag 0x10) and listed by purge_receipts.
struct PurgeReceipt {
  std::uint64_t user_id = 0;
  std::uint64_t left_at_ns = 0;         // the boundary: every removed contribution was forwarded before it
  std::uint64_t purged_at_ns = 0;       // Db clock
  std::uint64_t entries_removed = 0;    // ledger entries removed
  double cohort_weight_removed = 0;     // sum of removed cohort contributions (exact sum, nearest double)
  double community_weight_removed = 0;  // sum of removed community contributions
  // False while the purge's physical erasure has not finished (it failed, or
  // the process died during it): SST or WAL files may still hold the removed
  // ledger records. The user's next purge, or the next writable open,
  // finishes it. The purge itself (scores, ledger, receipt) is complete.
  bool erasure_complete = true;
};

// The outcome of rematerialize_shared_aggregates.
struct RematerializeReport {
  std::uint64_t aggregates_checked = 0;
  std::uint64_t ledger_entries_read = 0;
  std::vector<std::string> mismatches;  // one line each: key, stored, recomputed
  bool repaired = false;                // true when repair rewrote the mismatching aggregates
};

class Db {
 public:
  // Opens (or creates) the Db in directory `path`. Fails with a Status naming
  // the path and the cause when the path is held by another handle, is a
  // file, or is not writable (G8); with Corruption when a leave record does
  // not decode (under CorruptRecordPolicy::Fail). Every Left user is gated
  // before open returns (G5).
  static Result<std::unique_ptr<Db>> open(const std::string& path, const Options& options = {});

  ~Db();
  Db(const Db&) = delete;
  Db& operator=(const Db&) = delete;

  // Writes the pending aggregate updates (one write), flushes memtables and
  // closes. Idempotent; after it every call returns Closed. An error of the
  // background writer that was never overcome is returned here. Calls that
  // start once close() has begun return Closed at once; close() waits only
  // for the calls and signals already in flight, so callers on other threads
  // cannot starve it. Busy from inside a ContributionSink callback, and from
  // inside a for_each_left callback of the same Db (close would wait for itself).
  //
  // After a storage error (a full disk), close() waits for the writes to
  // resume first, as any call does (flush below): once the cause is gone it
  // returns OK. A close() that failed is not repeated: a second call
  // returns OK.
  //
  // A Db still open when the process exits (std::exit, or a return from
  // main) is closed by an exit handler that tidal registers at its first
  // open, before the static objects that RocksDB needs are destroyed; its
  // destructor then does nothing. So a Db held in a global or static
  // std::unique_ptr is safe, and what it acknowledged is kept.
  Status close();

  // Writes every aggregate update acknowledged so far, durably (the state
  // store fsyncs every batch, whatever sync_writes says), keeping the Db
  // open. The writer's error when it fails.
  //
  // Storage errors (every call that writes): a failed write, fsync, flush or
  // ingestion (ENOSPC on a full disk) stops the engine's writes; the error
  // says what to do. The Db recovers in place: it resumes the engine by
  // itself once the cause is gone (space freed), and a call that writes
  // waits for that first, so a retry of the failed call then works on the
  // same handle, no reopen needed (docs/CONTRACT.md G6); while the cause
  // stays, the call fails within about a second saying so, changing nothing.
  // An error the engine does not recover from (EIO, a read-only file system)
  // says to close the Db and open it again. A write that failed is not in
  // the Db once it has recovered (or been reopened); until then a crash may
  // still bring it back from the WAL, and each call below says what its
  // retry does in either case.
  Status flush();

  // Wraps every bucket key of the key store with `new_key` (32 bytes) in one
  // synced write, then flushes the users engine past its WALs and compacts
  // the bucket keys, so that on return no WAL or SST file of the Db holds a
  // bucket key wrapped with the previous key-encryption key (or in clear, for
  // a Db that had none: it gets `new_key`). Every record stays readable;
  // every later open needs `new_key` (Options::key_encryption_key). On an
  // error before the write nothing changed; after it (the flush or the
  // compaction failed) the Db uses `new_key` and a later call finishes the
  // removal. InvalidArgument when `new_key` is not 32 bytes or the Db is
  // read-only. Thread-safe; other calls go on meanwhile.
  Status rotate_key_encryption_key(const std::string& new_key);

  // Joins/exits a community. Durable before returning; joining twice or
  // exiting a community one is not in returns OK and changes nothing.
  Status join_community(std::uint64_t user_id, std::uint64_t community_id);
  Status exit_community(std::uint64_t user_id, std::uint64_t community_id);
  // The user's communities in ascending order (empty when none).
  Result<std::vector<std::uint64_t>> communities_of(std::uint64_t user_id) const;

  // Applies a signal: the user's personal layer always; the cohorts of
  // `context` and the user's communities unless the user has left. The
  // updates are in memory when this returns and stored by the background
  // writer. InvalidArgument, with nothing changed, for a weight that is not
  // finite or exceeds 1e12 in magnitude, and for a context of more than
  // kMaxCohortsPerSignal cohorts. When the write buffers are full it waits
  // for the writer (from inside a ContributionSink callback: Busy at once);
  // if the writer is failing, it returns its error. While the state store's
  // compactions are behind it may sleep to keep all threads' signals to the
  // admission rate (never from inside a callback); far behind (the end of
  // the debt range) it returns Busy at once, with nothing changed: retry
  // later (docs/CONTRACT.md "Admission").
  // With a contribution_sink, the signal first takes the time its
  // contributions carry; when it cannot (an exhausted clock, or the clock's
  // floor, written about once a second, could not be stored) it fails with
  // that error and nothing changed.
  Result<SignalOutcome> signal_with_context(const Signal& signal, const SignalContext& context);
  // Exact sums of the accepted weights (integers of 1e-9), converted to the
  // nearest double: the order of signals never changes a score. 0 for what
  // was never touched; a non-OK Status when the read failed (Corruption
  // naming the key for a malformed stored value), Closed on a closed Db.
  Result<double> personal_score(std::uint64_t user_id, std::uint64_t item_id) const;
  Result<double> cohort_score(std::uint64_t cohort_id, std::uint64_t item_id) const;
  Result<double> community_score(std::uint64_t community_id, std::uint64_t item_id) const;

  // Leaves the community layer: durable (G1) and effective (G2) on return,
  // with left_at_ns above every earlier contribution's forwarded_at_ns (G3).
  // OK and no change when already Left (G7). On a storage error the error is
  // returned and the gate stays closed for the user (G6); a retry completes
  // the leave once the cause is gone (space freed), without a reopen.
  // With Options::journal, the leave, and each rejoin or bulk change below
  // that changes state, appends a journal entry in the same write (a call
  // that changes nothing appends none). With journal_wait, OK comes once
  // the entry is confirmed (a call that changes nothing: once every entry
  // written before it is), NotReplicated after journal_wait: durable and
  // effective all the same, and a retry is safe (docs/CONTRACT.md J4).
  Status leave_community_layer(std::uint64_t user_id);
  // Resumes forwarding; keeps left_at_ns and the history (G4). OK and no
  // change when already Active. On error the gate stays closed.
  Status rejoin_community_layer(std::uint64_t user_id);
  // Bulk forms: the guarantees of the single forms (G1-G7) for every listed
  // user, written in synced WriteBatches of 10,000 users (one fsync each)
  // after a single grace period. On OK each listed user that was not yet
  // Left (Active) has its own left_at_ns (its own rejoin time) and the
  // change is durable and effective. Duplicate ids and users already in the
  // target state are no-ops (G7); an empty span returns OK. On a storage
  // error the error is returned, naming how many users were written before
  // it; the written ones keep their new state, and every other listed user
  // stays gated (G6): a retry of the same call completes it. The call holds
  // the listed users' lock stripes throughout, so single leaves and rejoins
  // of users sharing a stripe wait for it (about 1 s per 100,000 users).
  Status leave_community_layer(std::span<const std::uint64_t> user_ids);
  Status rejoin_community_layer(std::span<const std::uint64_t> user_ids);
  // The durable state; a user never seen is Active with no leave time.
  Result<CommunityMembership> community_layer_status(std::uint64_t user_id) const;
  // Every leave and rejoin of the user, oldest first.
  Result<std::vector<MembershipEvent>> community_layer_history(std::uint64_t user_id) const;
  // Signals the gate held back for the user since the last leave.
  Result<GateActivity> gate_activity(std::uint64_t user_id) const;

  // Calls `fn` for every user whose state is Left, in ascending user order,
  // streaming from storage; stops early when `fn` returns false. `fn` may
  // call the Db's other methods, except close() (Busy).
  Status for_each_left(const std::function<bool(const CommunityMembership&)>& fn) const;

  // Decodes every record and cross-checks the leave records against their
  // index. A non-OK Status only when verification itself could not run.
  Result<VerifyReport> verify() const;

  // Retroactive purge (docs/CONTRACT.md P1-P7, docs/PURGE.md). Requires the
  // user to be Left (else InvalidArgument naming the user and their status,
  // nothing changed). Subtracts every contribution the user made to a
  // cohort or community aggregate (all forwarded before left_at_ns), deletes
  // the user's ledger entries and writes the receipt, in one atomic,
  // fsynced step: a crash leaves it all done or not done. Then erases the
  // ledger physically. On OK every shared score equals that of a Db that
  // never received the user's contributions, bit for bit, and no SST or WAL
  // file of the Db holds a purged record of the user's ledger (docs/PURGE.md
  // says what RocksDB's MANIFEST keeps), even while other threads signal and
  // read. The personal layer is untouched. Nothing left to remove: a receipt
  // with entries_removed == 0, nothing written (but an earlier purge's
  // erasure that had not finished is finished first).
  //
  // Errors: when the batch's write fails, its outcome is unknown (a failed
  // fsync may still have reached the disk): the message says so, and
  // purge_receipts tells once the Db has recovered from the error (by
  // itself, once the cause is gone: flush() above) or been reopened; a retry
  // of the purge is safe either way (it purges what is left, if anything). When the erasure fails (or the
  // process dies during it), the purge itself is complete and durable, the
  // receipt says erasure_complete == false, and the user's next purge or the
  // Db's next writable open finishes the erasure.
  //
  // Locking: the user's leaves and rejoins wait for the durable batch only,
  // not for the erasure (a rejoin during it keeps its fresh ledger). Purges
  // erase one at a time.
  //
  // With Options::journal, the purge's intent (a journal entry naming the
  // receipt's purged_at_ns) is written durably before anything is purged; a
  // crash or error after it is finished by the next writable open, with
  // that receipt (docs/CONTRACT.md J6); until then a rejoin of its users
  // returns Busy. With journal_wait, OK comes once the
  // intent is confirmed, NotReplicated after journal_wait (the purge is
  // done; a retry writes another intent and removes nothing more).
  Result<PurgeReceipt> purge_community_contributions(std::uint64_t user_id);
  // Bulk form: every listed user must be Left (else InvalidArgument, nothing
  // changed); one flush, atomic batches of up to 1,000 whole users (built in
  // bounded memory, as the single form), then one erasure that compacts only the
  // listed users' ledger ranges. Receipts in ascending user order
  // (duplicates purged once). On a storage error the message names the
  // batch whose outcome is unknown; the users of the batches before it are
  // purged (their receipts exist), those after it untouched.
  Result<std::vector<PurgeReceipt>> purge_community_contributions(std::span<const std::uint64_t> user_ids);
  // Every receipt of the user, oldest first.
  Result<std::vector<PurgeReceipt>> purge_receipts(std::uint64_t user_id) const;
  // Recomputes every cohort and community aggregate from the ledger and
  // compares exactly; with `repair`, rewrites the differing ones in one synced
  // batch. No aggregate write interleaves (the background writer waits).
  Result<RematerializeReport> rematerialize_shared_aggregates(bool repair = false);

  Stats stats() const;

  // The change feed (Options::change_feed; docs/CONTRACT.md "Change feed").
  // InvalidArgument when the Db keeps none. Batches with seq > after_seq,
  // oldest first, up to about max_bytes of payload (at least one when there
  // is one; empty when none is newer); NotFound when some of them were
  // trimmed already. A batch is readable once its write is durable.
  Result<std::vector<ChangeBatch>> read_changes(std::uint64_t after_seq, std::size_t max_bytes) const;
  // The last batch's seq; 0 before the first.
  Result<std::uint64_t> last_change_seq() const;
  // The feed may forget batches up to through_seq (durable on return).
  // InvalidArgument past the last seq; OK and nothing changed at or below
  // the trim point.
  Status trim_changes(std::uint64_t through_seq);
  // Re-seeds the change feed (docs/SCALE.md, "Re-seeding a shard"): how a
  // shard whose views went wrong (a restore from an older copy, a fresh Db
  // for a shard with history, a gap that cannot be filled, a twin) makes
  // every view equal its current aggregates again, without rebuilding views
  // from every shard. In one atomic, durable step the feed gets a new
  // incarnation, its untrimmed batches are trimmed (the snapshot supersedes
  // them), and a snapshot of every nonzero cohort and community aggregate is
  // appended as the next batches; a view that applies the snapshot's first
  // batch replaces what it held of this shard by those values (exactly: the
  // view keeps each shard's sums apart), and the Publisher publishes it over
  // the stream's batches of the old incarnation (fenced, as every batch).
  // Returns the seq of the snapshot's first batch. Signals, purges and
  // repairs wait while the aggregates are read (about 1 s a million shared
  // cells); the snapshot's bytes count against change_feed_max_bytes until
  // published. InvalidArgument when the Db keeps no feed or is read-only.
  Result<std::uint64_t> reseed_change_feed();

  // Backup and restore (docs/CONTRACT.md, "Backup and restore").
  //
  // Writes a consistent point-in-time copy of both engines into directory
  // `dir`, which must not exist (its parent must): everything acknowledged
  // before the call, in the Db's own layout, with a manifest (TIDAL_BACKUP:
  // the change feed's shard, incarnation and seqs, whether the files were
  // hard-linked or copied, how long it took). SST files are hard-linked
  // where the file system allows (the same one as the Db), copied
  // otherwise. Signals and leaves go on meanwhile; a purge that starts
  // during the copy waits for it before it begins. InvalidArgument
  // naming what was wrong (dir exists, no parent, a read-only Db); IOError
  // naming the bytes needed and free, before anything is written, when the
  // parent's file system lacks room for what the backup flushes and copies
  // (with 1 % and 1 MiB to spare); nothing of `dir` is left when it fails. The copy is assembled in
  // "<dir>.tidal-backup-tmp" and renamed to `dir` once whole; a backup
  // killed mid-way leaves that directory, which the Db's next writable open
  // removes (a marker in the Db's directory names it).
  Status backup(const std::string& dir) const;
  // A Db opened from a backup (a directory holding its manifest) is
  // recovering: signals and every call that reads or changes a user's
  // community status are Busy, naming the steps, until the journal entries
  // after the backup's position are replayed and finish_recovery() is
  // called. finish_recovery() re-seeds the change feed (a new incarnation:
  // every view replaces the shard's contribution by the restored Db's) and
  // removes the manifest, durably. OK and nothing done when not recovering.
  Status finish_recovery();
  // Re-applies, in a recovering Db, the privacy journal's entries written
  // after its backup (read back from where the journal was replicated:
  // tidal::nats::recover_shard reads them from the journal's stream), each
  // exactly as first made and at its own seq, in one durable write with its
  // own journal entry: a leave with its original left_at_ns (the exact
  // boundary), a rejoin keeping it, a purge re-run against the restored
  // ledger with its original boundary and receipt identity (skipped when
  // the copy holds that receipt). Entries at or below last_journal_seq()
  // are in the Db already and skipped (idempotent: replaying twice is safe;
  // one the Db still holds must be byte-identical, Corruption otherwise).
  // Corruption for a gap (an entry past last_journal_seq() + 1, naming
  // both), a payload that does not decode, or a purge whose user is not Left
  // at its boundary; InvalidArgument for another shard, a Db without a
  // journal, or one that is not recovering. What was applied before an
  // error stays applied; call again from there (after a storage error, once
  // its cause is gone: the Db recovers in place; a purge whose intent was
  // written is finished first).
  Status replay_journal(std::span<const JournalEntry> entries);
  // The privacy journal (Options::journal; docs/CONTRACT.md J1-J6).
  // InvalidArgument when the Db keeps none. Entries with seq > after_seq,
  // oldest first, up to about max_bytes of payload (at least one when there
  // is one; empty when none is newer); NotFound when some of them were
  // confirmed and removed already. An entry is readable once its write is
  // durable.
  Result<std::vector<JournalEntry>> read_journal(std::uint64_t after_seq, std::size_t max_bytes) const;
  // The last entry's seq; 0 before the first.
  Result<std::uint64_t> last_journal_seq() const;
  // Waits until the journal holds an entry with seq > after_seq, for at
  // most `wait`, or until close() begins; returns the last seq then (at or
  // below after_seq when none came in time). What a journal's publisher
  // waits on, so that a leave waiting for its confirmation
  // (Options::journal_wait) is published at once rather than at its next
  // poll. InvalidArgument when the Db keeps none; Closed once closed.
  Result<std::uint64_t> wait_journal(std::uint64_t after_seq, std::chrono::milliseconds wait) const;
  // The journal is replicated through through_seq: leaves, rejoins and
  // purges waiting for entries up to it (Options::journal_wait) return OK
  // as soon as the call begins; the point is stored and the entries
  // removed by a write that is not synced (durable with the next synced
  // write; a power cut before it brings the entries back unconfirmed, and
  // a publisher that finds them in the stream confirms them again).
  // InvalidArgument past the last seq; OK and nothing changed at or below
  // the confirmed point.
  Status confirm_journal(std::uint64_t through_seq);

  class Impl;

 private:
  explicit Db(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidal

#endif  // TIDAL_DB_H_
