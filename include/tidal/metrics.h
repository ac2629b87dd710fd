// Metrics in the Prometheus text exposition format (version 0.0.4), for a
// host to serve on its /metrics endpoint or hand to any collector that reads
// it (Prometheus, the OpenTelemetry collector, Datadog's and Grafana's
// agents):
//
//   tidal::Result<std::string> text = tidal::prometheus_text(db.stats(), {{"shard", "7"}});
//
// One metric family per field of Db::stats(), named tidal_db_<field>;
// counters (totals since the open) end in _total, gauges (a value now) do
// not; each family has its HELP and TYPE lines. A GlobalView's progress
// (applied_shards()) renders as tidal_view_applied_seq{shard="..."}, and
// tidal::nats's PublisherStats and FollowerStats in tidal/nats.h.
// docs/SCALE.md ("What to monitor") says which to alert on.
#ifndef TIDAL_METRICS_H_
#define TIDAL_METRICS_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tidal/db.h"
#include "tidal/global_view.h"
#include "tidal/status.h"

namespace tidal {

// Label names and values put on samples, e.g. {{"shard", "7"}}.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

// A builder of text in the exposition format; the renderers below use it,
// and a host may add its own families. Values are written exactly (integers
// in decimal); label values are escaped (backslash, double quote, newline).
class PrometheusText {
 public:
  // `labels` go on every sample. InvalidArgument, naming the label, for a
  // name that is not [a-zA-Z_][a-zA-Z0-9_]*, that starts with "__"
  // (reserved), or that appears twice.
  static Result<PrometheusText> with_labels(MetricLabels labels);

  // Starts a family: its HELP and TYPE lines. `type` is "counter" or
  // "gauge". `name` must be a metric name ([a-zA-Z_:][a-zA-Z0-9_:]*; a
  // counter's ends in _total); InvalidArgument otherwise.
  Status family(std::string_view name, std::string_view type, std::string_view help);
  // A sample of the family started last, with the common labels and
  // `extra` (checked like the common ones).
  Status sample(std::uint64_t value, const MetricLabels& extra = {});
  // A family of one sample each: family(name, type, help), then
  // sample(value, extra), row by row; the first error stops it.
  struct Row {
    std::string_view name;
    std::string_view type;
    std::uint64_t value;
    std::string_view help;
  };
  Status rows(std::initializer_list<Row> rows, const MetricLabels& extra = {});

  const std::string& text() const { return text_; }

 private:
  explicit PrometheusText(MetricLabels labels) : labels_(std::move(labels)) {}
  MetricLabels labels_;
  std::string family_;  // the family samples belong to
  std::string text_;
};

// Db::stats() as text; `labels` on every sample (e.g. the shard or the
// Db's name). InvalidArgument for a bad label (PrometheusText).
Result<std::string> prometheus_text(const Stats& stats, const MetricLabels& labels = {});
// A GlobalView's applied_shards(): tidal_view_shards (gauge) and
// tidal_view_applied_seq{shard="<id>"} (gauge) per shard.
Result<std::string> prometheus_text(const std::vector<ShardProgress>& view_shards, const MetricLabels& labels = {});

}  // namespace tidal

#endif  // TIDAL_METRICS_H_
