// The Prometheus text format (include/tidal/metrics.h).
#include "tidal/metrics.h"

#include <set>

namespace tidal {
namespace {

bool name_char(char c, bool first, bool colon) {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
  return alpha || (!first && c >= '0' && c <= '9');
}

bool valid_name(std::string_view name, bool colon) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    if (!name_char(name[i], i == 0, colon)) return false;
  }
  return true;
}

Status check_labels(const MetricLabels& labels, const MetricLabels& common) {
  std::set<std::string_view> seen;
  for (const auto& [name, value] : common) seen.insert(name);
  for (const auto& [name, value] : labels) {
    if (!valid_name(name, /*colon=*/false) || name.starts_with("__")) {
      return Status::InvalidArgument("metric label name '" + name +
                                     "' is not valid: it must match [a-zA-Z_][a-zA-Z0-9_]* and not start with __");
    }
    if (!seen.insert(name).second) return Status::InvalidArgument("metric label '" + name + "' is given twice");
  }
  return Status::OK();
}

void append_labels(std::string* out, const MetricLabels& labels) {
  for (const auto& [name, value] : labels) {
    if (out->back() != '{') out->push_back(',');
    out->append(name);
    out->append("=\"");
    for (char c : value) {
      if (c == '\\') out->append("\\\\");
      else if (c == '"') out->append("\\\"");
      else if (c == '\n') out->append("\\n");
      else out->push_back(c);
    }
    out->push_back('"');
  }
}

}  // namespace

Result<PrometheusText> PrometheusText::with_labels(MetricLabels labels) {
  if (Status s = check_labels(labels, {}); !s.ok()) return s;
  return PrometheusText(std::move(labels));
}

Status PrometheusText::family(std::string_view name, std::string_view type, std::string_view help) {
  if (!valid_name(name, /*colon=*/true)) {
    return Status::InvalidArgument("metric name '" + std::string(name) + "' is not valid: it must match "
                                   "[a-zA-Z_:][a-zA-Z0-9_:]*");
  }
  if (type != "counter" && type != "gauge") {
    return Status::InvalidArgument("metric " + std::string(name) + ": type '" + std::string(type) +
                                   "' is not counter or gauge");
  }
  if ((type == "counter") != name.ends_with("_total")) {
    return Status::InvalidArgument("metric " + std::string(name) + ": a counter's name ends in _total, and only a "
                                   "counter's");
  }
  family_ = name;
  text_ += "# HELP " + family_ + ' ';
  for (char c : help) {
    if (c == '\\') text_ += "\\\\";
    else if (c == '\n') text_ += "\\n";
    else text_ += c;
  }
  text_ += "\n# TYPE " + family_ + ' ' + std::string(type) + '\n';
  return Status::OK();
}

Status PrometheusText::sample(std::uint64_t value, const MetricLabels& extra) {
  if (family_.empty()) return Status::InvalidArgument("metric sample before any family");
  if (Status s = check_labels(extra, labels_); !s.ok()) return s;
  text_ += family_;
  if (!labels_.empty() || !extra.empty()) {
    text_ += '{';
    append_labels(&text_, labels_);
    append_labels(&text_, extra);
    text_ += '}';
  }
  text_ += ' ' + std::to_string(value) + '\n';
  return Status::OK();
}

Status PrometheusText::rows(std::initializer_list<Row> rows, const MetricLabels& extra) {
  for (const Row& row : rows) {
    if (Status s = family(row.name, row.type, row.help); !s.ok()) return s;
    if (Status s = sample(row.value, extra); !s.ok()) return s;
  }
  return Status::OK();
}

Result<std::string> prometheus_text(const Stats& st, const MetricLabels& labels) {
  Result<PrometheusText> out = PrometheusText::with_labels(labels);
  if (!out.ok()) return out.status();
  const Status s = out->rows({
      {"tidal_db_signals_total", "counter", st.signals, "Accepted signal_with_context calls."},
      {"tidal_db_personal_updates_total", "counter", st.personal_updates, "Personal-layer cells updated."},
      {"tidal_db_cohort_attributions_total", "counter", st.cohort_attributions, "Cohort additions."},
      {"tidal_db_community_forwards_total", "counter", st.community_forwards, "Community additions."},
      {"tidal_db_gated_cohort_total", "counter", st.gated_cohort, "Signals the leave gate held back from cohorts."},
      {"tidal_db_gated_community_total", "counter", st.gated_community,
       "Signals the leave gate held back from communities."},
      {"tidal_db_leaves_total", "counter", st.leaves, "Leaves that changed a user's state."},
      {"tidal_db_rejoins_total", "counter", st.rejoins, "Rejoins that changed a user's state."},
      {"tidal_db_users_left", "gauge", st.users_left, "Users the leave gate holds back now."},
      {"tidal_db_corrupt_records_treated_as_left", "gauge", st.corrupt_records_treated_as_left,
       "Corrupt membership records found at open and treated as Left."},
      {"tidal_db_aggregate_writes_total", "counter", st.aggregate_writes, "Batches the background writer stored."},
      {"tidal_db_aggregate_write_failures_total", "counter", st.aggregate_write_failures,
       "Failed batch writes (kept in memory and retried); alert when it grows."},
      {"tidal_db_aggregate_cells_written_total", "counter", st.aggregate_cells_written,
       "Aggregate cells and ledger records stored."},
      {"tidal_db_aggregate_cells_pending", "gauge", st.aggregate_cells_pending, "Cells in memory, not yet stored."},
      {"tidal_db_backpressure_waits_total", "counter", st.backpressure_waits,
       "Signals that waited for the writer (buffers full)."},
      {"tidal_db_backpressure_wait_max_nanoseconds", "gauge", st.backpressure_wait_max_ns,
       "The longest time one signal waited at the write buffers' bound since open."},
      {"tidal_db_aggregate_write_max_nanoseconds", "gauge", st.aggregate_write_max_ns,
       "The longest batch write since open, from when it was due; the crash window is the write period plus "
       "this."},
      {"tidal_db_aggregate_write_p99_nanoseconds", "gauge", st.aggregate_write_p99_ns,
       "p99 of the last 1,000 batch writes."},
      {"tidal_db_admission_delayed_signals_total", "counter", st.admission_delayed_signals,
       "Signals that slept to keep to the admission rate while compactions were behind."},
      {"tidal_db_admission_delay_nanoseconds_total", "counter", st.admission_delay_ns,
       "Time those signals slept, in total."},
      {"tidal_db_admission_delay_max_nanoseconds", "gauge", st.admission_delay_max_ns,
       "The longest admission sleep of one signal since open."},
      {"tidal_db_admission_refused_signals_total", "counter", st.admission_refused_signals,
       "Signals refused with Busy at admission's hard stop (compactions far behind)."},
      {"tidal_db_admission_rate_bytes_per_second", "gauge", st.admission_rate_bytes_per_s,
       "The admission rate all signals together are held to now (0: no limit, or the hard stop)."},
      {"tidal_db_admission_signal_bytes", "gauge", st.admission_signal_bytes,
       "The bytes a signal counts as against the admission rate."},
      {"tidal_db_admission_stopped", "gauge", st.admission_stopped ? 1u : 0u,
       "1 at admission's hard stop: signals get Busy until compactions catch up."},
      {"tidal_db_compaction_debt_bytes", "gauge", st.compaction_debt_bytes,
       "Bytes the state engine's compactions have to rewrite (RocksDB's estimate)."},
      {"tidal_db_compaction_debt_l0_files", "gauge", st.compaction_debt_l0_files,
       "The most level-0 files of the aggregates or the ledger."},
      {"tidal_db_change_feed", "gauge", st.change_feed ? 1u : 0u, "1 when the Db keeps a change feed."},
      {"tidal_db_change_feed_last_seq", "gauge", st.change_feed_last_seq, "The last batch written to the feed."},
      {"tidal_db_change_feed_trimmed_seq", "gauge", st.change_feed_trimmed_seq, "The feed is trimmed through it."},
      {"tidal_db_change_feed_pending_bytes", "gauge", st.change_feed_pending_bytes,
       "Payload bytes of the untrimmed batches; at Options::change_feed_max_bytes signals get Busy."},
      {"tidal_db_change_feed_refused_signals_total", "counter", st.change_feed_refused_signals,
       "Signals refused (Busy, not applied) while the feed was at its bound: its consumers do not trim."},
      {"tidal_db_journal", "gauge", st.journal ? 1u : 0u, "1 when the Db keeps a privacy journal."},
      {"tidal_db_journal_last_seq", "gauge", st.journal_last_seq, "The last leave, rejoin or purge journaled."},
      {"tidal_db_journal_confirmed_seq", "gauge", st.journal_confirmed_seq,
       "The journal is confirmed replicated through it (confirm_journal)."},
      {"tidal_db_journal_pending_entries", "gauge", st.journal_pending_entries,
       "Journal entries not yet confirmed replicated: privacy events a lost disk would lose."},
      {"tidal_db_journal_pending_bytes", "gauge", st.journal_pending_bytes, "Their payload bytes."},
      {"tidal_db_journal_wait_timeouts_total", "counter", st.journal_wait_timeouts,
       "Calls that returned NotReplicated: durable here, not confirmed within Options::journal_wait."},
      {"tidal_db_ledger_check_records_read", "gauge", st.ledger_check_records_read,
       "Records the verify() and re-materialization checks under way have read (0: none runs)."},
      {"tidal_db_ledger_check_records_estimate", "gauge", st.ledger_check_records_estimate,
       "What those checks read in all, by RocksDB's estimate of the keys."},
      {"tidal_db_ledger_check_restarts_total", "counter", st.ledger_check_restarts,
       "Checks that let go of their snapshot for a purge's erasure and started over."},
  });
  if (!s.ok()) return s;
  return out->text();
}

Result<std::string> prometheus_text(const std::vector<ShardProgress>& view_shards, const MetricLabels& labels) {
  Result<PrometheusText> out = PrometheusText::with_labels(labels);
  if (!out.ok()) return out.status();
  if (Status s = out->family("tidal_view_shards", "gauge", "Shards whose batches the view has applied.");
      !s.ok()) {
    return s;
  }
  if (Status s = out->sample(view_shards.size()); !s.ok()) return s;
  if (Status s = out->family("tidal_view_applied_seq", "gauge", "The seq of the last batch applied, per shard.");
      !s.ok()) {
    return s;
  }
  for (const ShardProgress& p : view_shards) {
    if (Status s = out->sample(p.applied_seq, {{"shard", std::to_string(p.shard_id)}}); !s.ok()) return s;
  }
  return out->text();
}

}  // namespace tidal
