#include "nats/backfill.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>

namespace tidal::nats::internal {

namespace {

// The server deletes a probe's consumer this long after its Follower
// stopped asking (a probe normally deletes it at once).
constexpr std::chrono::seconds kProbeInactive{30};

// One message of a subject, as a probe found it.
struct Found {
  std::uint64_t stream_seq = 0;
  std::optional<ChangeBatch> batch;  // empty: not a batch (no shard, seq in its headers)
};

class Prober {
 public:
  Prober(Connection& conn, const Config& config, const std::string& where, BackfillStart* out)
      : conn_(conn), config_(config), where_(where), out_(out) {}

  // The first message on `subject` at stream seq >= from; nullopt when
  // there is none (the wait for it ran out).
  Result<std::optional<Found>> next(const std::string& subject, std::uint64_t from) {
    jsConsumerConfig cc;
    jsConsumerConfig_Init(&cc);
    cc.DeliverPolicy = js_DeliverByStartSequence;
    cc.OptStartSeq = std::max<std::uint64_t>(from, 1);
    cc.AckPolicy = js_AckNone;
    cc.FilterSubject = subject.c_str();
    cc.InactiveThreshold = std::chrono::duration_cast<std::chrono::nanoseconds>(kProbeInactive).count();
    Pull reader(conn_);  // deletes its consumer when it goes
    Status s = reader.open_ephemeral(config_.stream, cc);
    if (!s.ok()) {
      return Status::IOError(where_ + ": cannot read " + subject + " from stream seq " + std::to_string(from) +
                             " to find where the new consumer starts: " + s.message());
    }
    Fetched got;
    s = reader.fetch(1, config_.fetch_max_bytes, /*no_wait=*/false, config_.request_timeout, &got);
    if (!s.ok()) {
      return Status::IOError(where_ + ": reading " + subject + " from stream seq " + std::to_string(from) +
                             " to find where the new consumer starts failed: " + s.message());
    }
    if (got.msgs.empty()) return std::optional<Found>();
    return std::optional<Found>(found(got.msgs.front(), /*stream_seq=*/0));
  }

  // The subject's last message; nullopt when it has none.
  Result<std::optional<Found>> last(const std::string& subject) {
    natsMsg* m = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus ns = js_GetLastMsg(&m, conn_.js(), config_.stream.c_str(), subject.c_str(), nullptr, &jerr);
    if (ns == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr) return std::optional<Found>();
    if (ns != NATS_OK) {
      return Status::IOError(where_ + ": cannot read the last message on " + subject + ": " + nats_error(ns));
    }
    std::unique_ptr<natsMsg, void (*)(natsMsg*)> guard(m, natsMsg_Destroy);
    return std::optional<Found>(found(m, natsMsg_GetSequence(m)));
  }

 private:
  Found found(natsMsg* m, std::uint64_t stream_seq) {
    Found f;
    f.stream_seq = stream_seq;
    if (f.stream_seq == 0) {
      jsMsgMetaData* meta = nullptr;
      if (natsMsg_GetMetaData(&meta, m) == NATS_OK) {
        f.stream_seq = meta->Sequence.Stream;
        jsMsgMetaData_Destroy(meta);
      }
    }
    Result<ChangeBatch> b = batch_of(m, config_);
    if (b.ok()) f.batch = std::move(*b);
    ++out_->probes;
    out_->probe_bytes += static_cast<std::uint64_t>(std::max(natsMsg_GetDataLength(m), 0));
    return f;
  }

  Connection& conn_;
  const Config& config_;
  const std::string& where_;
  BackfillStart* out_;
};

// The first message of the subject with stream seq in [lo, last] that
// satisfies `holds`, given that `last` (the subject's message at the end of
// the range) does: `holds` must be false up to some message of the subject
// and true from it on. Binary search over stream seqs, each probe reading
// the subject's first message at or after a seq. nullopt when uncertain: a
// probe finds nothing or a message that is not a batch (the stream lost
// messages meanwhile, or something else publishes there).
Result<std::optional<Found>> search(Prober& prober, const std::string& subject, std::uint64_t lo, const Found& last,
                                    const std::function<bool(const Found&)>& holds) {
  std::uint64_t hi = last.stream_seq;
  Found at = last;  // the probe at hi, which holds
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    Result<std::optional<Found>> f = prober.next(subject, mid);
    if (!f.ok()) return f.status();
    if (!*f || !(*f)->batch || (*f)->stream_seq < mid) return std::optional<Found>();
    if (holds(**f)) {
      hi = mid;
      at = std::move(**f);
    } else if ((*f)->stream_seq >= hi) {
      return std::optional<Found>();  // the message at hi went meanwhile: uncertain
    } else {
      lo = (*f)->stream_seq + 1;  // false for every x up to the message found
    }
  }
  return std::optional<Found>(std::move(at));
}

bool shard_of(const Config& config, const std::string& subject, std::uint64_t* shard) {
  const std::string prefix = config.subject_prefix + ".";
  if (subject.size() <= prefix.size() || subject.compare(0, prefix.size(), prefix) != 0) return false;
  const char* begin = subject.data() + prefix.size();
  const char* end = subject.data() + subject.size();
  auto [p, ec] = std::from_chars(begin, end, *shard);
  return ec == std::errc() && p == end;
}

// The first stream seq of `subject` a view at `progress` may need (see
// backfill_start); `first` is the stream's first seq, the answer when
// anything is uncertain.
Result<std::uint64_t> needed_from(Prober& prober, const std::string& subject, const ShardProgress& progress,
                                  std::uint64_t first, std::uint64_t stream_last) {
  Result<std::optional<Found>> tail = prober.last(subject);
  if (!tail.ok()) return tail.status();
  if (!*tail) return first;  // emptied meanwhile: nothing known
  const Found last = std::move(**tail);
  if (!last.batch || last.batch->incarnation.empty() || progress.incarnation.empty()) return first;
  const std::string& mine = progress.incarnation;
  const std::uint64_t n = progress.applied_seq;
  if (last.batch->incarnation == mine) {
    // The subject ends in the view's incarnation: older incarnations, then
    // the view's run in seq order. The view needs that run from seq n + 1;
    // applied through the subject's last message, nothing of it up to the
    // stream's end.
    if (last.batch->seq <= n) return std::max(last.stream_seq, stream_last) + 1;
    Result<std::optional<Found>> x = search(prober, subject, first, last, [&](const Found& f) {
      return f.batch && f.batch->incarnation == mine && f.batch->seq > n;
    });
    if (!x.ok()) return x.status();
    return *x ? (*x)->stream_seq : first;
  }
  // Re-seeded since (or the view's incarnation is not on the subject): the
  // last incarnation's run is at the subject's end. Its first message, a
  // re-seed's first batch, replaces all the view held of the shard.
  const std::string theirs = last.batch->incarnation;
  Result<std::optional<Found>> x =
      search(prober, subject, first, last, [&](const Found& f) { return f.batch && f.batch->incarnation == theirs; });
  if (!x.ok()) return x.status();
  if (!*x || !is_reseed(*(*x)->batch)) return first;
  return (*x)->stream_seq;
}

}  // namespace

Result<BackfillStart> backfill_start(Connection& conn, const Config& config, const std::vector<ShardProgress>& applied,
                                     const std::string& where) {
  BackfillStart out;
  if (applied.empty()) return out;
  const std::string filter = config.subject_prefix + ".*";
  jsOptions o;
  jsOptions_Init(&o);
  o.Stream.Info.SubjectsFilter = filter.c_str();
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus ns = js_GetStreamInfo(&si, conn.js(), config.stream.c_str(), &o, &jerr);
  if (ns == NATS_NOT_FOUND || jerr == JSStreamNotFoundErr) return out;
  if (ns != NATS_OK) {
    return Status::IOError(where + ": cannot list the stream's subjects to find where the new consumer starts: " +
                           nats_error(ns));
  }
  std::unique_ptr<jsStreamInfo, void (*)(jsStreamInfo*)> guard(si, jsStreamInfo_Destroy);
  const jsStreamState& state = si->State;
  if (state.Msgs == 0) return out;
  const std::uint64_t first = state.FirstSeq;
  // A subject list the server cut short: start from the first message.
  if (state.Subjects == nullptr || static_cast<std::int64_t>(state.Subjects->Count) < state.NumSubjects) return out;
  std::map<std::uint64_t, const ShardProgress*> by_shard;
  for (const ShardProgress& p : applied) by_shard[p.shard_id] = &p;
  Prober prober(conn, config, where, &out);
  std::uint64_t start = state.LastSeq + 1;
  for (int i = 0; i < state.Subjects->Count && start > first; ++i) {
    const jsStreamStateSubject& subj = state.Subjects->List[i];
    if (subj.Subject == nullptr || subj.Msgs == 0) continue;
    const std::string subject = subj.Subject;
    std::uint64_t shard = 0;
    // A subject of no shard holds no batch: nothing waits for it.
    if (!shard_of(config, subject, &shard)) continue;
    auto it = by_shard.find(shard);
    if (it == by_shard.end()) {
      // A shard the view never applied: from its subject's first message.
      Result<std::optional<Found>> f = prober.next(subject, first);
      if (!f.ok()) return f.status();
      start = std::min(start, *f ? (*f)->stream_seq : first);
      continue;
    }
    Result<std::uint64_t> x = needed_from(prober, subject, *it->second, first, state.LastSeq);
    if (!x.ok()) return x.status();
    start = std::min(start, *x);
  }
  out.stream_seq = start <= first ? 0 : start;
  return out;
}

}  // namespace tidal::nats::internal
