// PublisherStats and FollowerStats in the Prometheus text format
// (include/tidal/nats.h, tidal/metrics.h).
#include <cstdint>
#include <string>

#include "tidal/metrics.h"
#include "tidal/nats.h"

namespace tidal::nats {

Result<std::string> prometheus_text(const PublisherStats& st, const MetricLabels& labels) {
  Result<PrometheusText> out = PrometheusText::with_labels(labels);
  if (!out.ok()) return out.status();
  const Status s = out->rows(
      {
          {"tidal_publisher_published_seq", "gauge", st.published_seq,
           "The last seq the stream acknowledged (the feed is trimmed through it)."},
          {"tidal_publisher_last_change_seq", "gauge", st.last_change_seq, "The Db's last seq, when last read."},
          {"tidal_publisher_lag_batches", "gauge", st.lag_batches,
           "Batches written but not yet acknowledged by the stream; alert when it keeps growing."},
          {"tidal_publisher_lag_bytes", "gauge", st.lag_bytes,
           "Payload bytes not yet trimmed; signals get Busy when it reaches Options::change_feed_max_bytes."},
          {"tidal_publisher_published_batches_total", "counter", st.published_batches,
           "Acknowledged publishes since start, duplicates included."},
          {"tidal_publisher_duplicates_total", "counter", st.duplicates,
           "Acks JetStream flagged as duplicates (a batch sent again, checked against the stored one)."},
          {"tidal_publisher_errors_total", "counter", st.errors, "Failed attempts, each retried."},
          {"tidal_publisher_connects_total", "counter", st.connects, "Connections made."},
          {"tidal_publisher_reseeds_total", "counter", st.reseeds,
           "Re-seeds published over the stream's batches of another incarnation (Db::reseed_change_feed)."},
          {"tidal_publisher_connected", "gauge", st.connected ? 1u : 0u, "1 when connected with the stream checked."},
          {"tidal_publisher_halted", "gauge", st.halted ? 1u : 0u,
           "1 when a fence stopped the publisher for good (a twin, a restored Db): page an operator."},
      },
      {{"shard", std::to_string(st.shard_id)}});
  if (!s.ok()) return s;
  return out->text();
}

Result<std::string> prometheus_text(const FollowerStats& st, const MetricLabels& labels) {
  Result<PrometheusText> out = PrometheusText::with_labels(labels);
  if (!out.ok()) return out.status();
  Status s = out->rows(
      {
          {"tidal_follower_applied_batches_total", "counter", st.applied_batches, "Messages applied since start."},
          {"tidal_follower_redeliveries_skipped_total", "counter", st.redeliveries_skipped,
           "Messages the view had applied already (acked, nothing changed)."},
          {"tidal_follower_superseded_skipped_total", "counter", st.superseded_skipped,
           "Messages of an incarnation older than one the view applied for their shard (acked, nothing changed)."},
          {"tidal_follower_gaps_total", "counter", st.gaps,
           "Messages refused (a gap, another incarnation, undecodable): not acked, delivered again later."},
          {"tidal_follower_errors_total", "counter", st.errors, "Failed attempts, each retried."},
          {"tidal_follower_lag_messages", "gauge", st.lag_messages,
           "Stream messages not yet delivered to this consumer."},
          {"tidal_follower_connects_total", "counter", st.connects, "Connections made."},
          {"tidal_follower_connected", "gauge", st.connected ? 1u : 0u, "1 when connected with the consumer bound."},
          {"tidal_follower_stalled_on_gap", "gauge", st.stalled_on_gap ? 1u : 0u,
           "1 when the last message seen was a gap: the view waits for the missing batch."},
          {"tidal_follower_view_writes_total", "counter", st.view_writes, "GlobalView::apply calls."},
          {"tidal_follower_apply_microseconds_total", "counter", st.apply_micros, "Time spent in those calls."},
          {"tidal_follower_fetched_messages_total", "counter", st.fetched_messages,
           "Messages read from the stream (consumer, parked shards' reads, backfill probes)."},
          {"tidal_follower_fetched_bytes_total", "counter", st.fetched_bytes, "Payload bytes of those messages."},
          {"tidal_follower_backfill_start_seq", "gauge", st.backfill_start_seq,
           "Stream seq the consumer was created at for a view from a checkpoint (0: the stream's first message)."},
          {"tidal_follower_backfill_probes_total", "counter", st.backfill_probes,
           "Messages read to find where a new consumer starts."},
      },
      {});
  if (!s.ok()) return s;
  s = out->family("tidal_follower_applied_seq", "gauge", "The view's applied seq, per shard.");
  for (const ShardProgress& p : st.applied) {
    if (!s.ok()) break;
    s = out->sample(p.applied_seq, {{"shard", std::to_string(p.shard_id)}});
  }
  if (!s.ok()) return s;
  // Per shard, as the Follower sees it: one family at a time, a sample per shard.
  struct PerShard {
    const char* name;
    const char* type;
    const char* help;
    std::uint64_t (*value)(const FollowerShardStats&);
  };
  static constexpr PerShard kPerShard[] = {
      {"tidal_follower_shard_stream_seq", "gauge", "The highest seq of the shard the Follower has seen in the stream.",
       [](const FollowerShardStats& x) { return x.stream_seq; }},
      {"tidal_follower_shard_lag_batches", "gauge",
       "Batches of the shard seen in the stream and not applied; alert when it grows for one shard.",
       [](const FollowerShardStats& x) { return x.lag_batches; }},
      {"tidal_follower_shard_parked", "gauge",
       "1 while a refused batch (a gap, another incarnation) parks the shard; the other shards keep applying.",
       [](const FollowerShardStats& x) -> std::uint64_t { return x.parked ? 1u : 0u; }},
      {"tidal_follower_shard_refused_total", "counter", "Messages of the shard the view refused.",
       [](const FollowerShardStats& x) { return x.refused; }},
  };
  for (const PerShard& f : kPerShard) {
    if (s = out->family(f.name, f.type, f.help); !s.ok()) return s;
    for (const FollowerShardStats& x : st.shards) {
      if (s = out->sample(f.value(x), {{"shard", std::to_string(x.shard_id)}}); !s.ok()) return s;
    }
  }
  return out->text();
}

}  // namespace tidal::nats
