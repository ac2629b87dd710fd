// Metrics in the Prometheus text format (include/tidal/metrics.h): the text
// parses by the exposition format's rules, each sample carries its labels
// (escaped and read back), and each value is the field of stats() it names.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "prometheus_parse.h"
#include "test_util.h"
#include "tidal/db.h"
#include "tidal/global_view.h"
#include "tidal/metrics.h"

namespace tidal {
namespace {

using testing::one;
using testing::open_db;
using testing::parse;
using testing::Sample;
using testing::TempDir;

TEST(Metrics, ADbsStatsRenderAsPrometheusTextWithEveryValueAndLabel) {
  TempDir dir;
  Options options;
  options.change_feed = true;
  options.journal = true;
  options.shard_id = 7;
  auto db = open_db(dir.path(), options);
  ASSERT_NE(db, nullptr);
  for (std::uint64_t u = 1; u <= 5; ++u) ASSERT_OK(db->signal_with_context({u, 9, 1.0}, {{3}}));
  ASSERT_OK(db->leave_community_layer(2));
  ASSERT_OK(db->signal_with_context({2, 9, 1.0}, {{3}}));  // held back by the gate
  ASSERT_OK(db->flush());
  const Stats st = db->stats();
  const std::string odd = "a \"quoted\" \\ back\nslash";
  Result<std::string> text = prometheus_text(st, {{"shard", "7"}, {"db", odd}});
  ASSERT_OK(text.status());
  const std::vector<Sample> samples = parse(*text);
  ASSERT_FALSE(::testing::Test::HasFailure()) << *text;
  EXPECT_EQ(samples.size(), 41u);
  for (const Sample& s : samples) {
    EXPECT_EQ(s.labels, (MetricLabels{{"shard", "7"}, {"db", odd}})) << s.name;
  }
  EXPECT_EQ(one(samples, "tidal_db_signals_total").value, st.signals);
  EXPECT_EQ(st.signals, 6u);
  EXPECT_EQ(one(samples, "tidal_db_leaves_total").value, 1u);
  EXPECT_EQ(one(samples, "tidal_db_users_left").value, 1u);
  EXPECT_EQ(one(samples, "tidal_db_gated_cohort_total").value, st.gated_cohort);
  EXPECT_EQ(st.gated_cohort, 1u);
  EXPECT_EQ(one(samples, "tidal_db_cohort_attributions_total").value, st.cohort_attributions);
  EXPECT_EQ(one(samples, "tidal_db_aggregate_writes_total").value, st.aggregate_writes);
  EXPECT_GE(st.aggregate_writes, 1u);
  EXPECT_EQ(one(samples, "tidal_db_aggregate_write_max_nanoseconds").value, st.aggregate_write_max_ns);
  EXPECT_EQ(one(samples, "tidal_db_admission_rate_bytes_per_second").value, st.admission_rate_bytes_per_s);
  EXPECT_EQ(one(samples, "tidal_db_admission_signal_bytes").value, st.admission_signal_bytes);
  EXPECT_GT(st.admission_signal_bytes, 0u);
  EXPECT_EQ(one(samples, "tidal_db_admission_stopped").value, 0u);
  EXPECT_EQ(one(samples, "tidal_db_admission_refused_signals_total").value, st.admission_refused_signals);
  EXPECT_EQ(one(samples, "tidal_db_admission_delay_max_nanoseconds").value, st.admission_delay_max_ns);
  EXPECT_EQ(one(samples, "tidal_db_backpressure_wait_max_nanoseconds").value, st.backpressure_wait_max_ns);
  EXPECT_EQ(one(samples, "tidal_db_change_feed").value, 1u);
  EXPECT_EQ(one(samples, "tidal_db_change_feed_last_seq").value, st.change_feed_last_seq);
  EXPECT_GE(st.change_feed_last_seq, 1u);
  EXPECT_EQ(one(samples, "tidal_db_change_feed_pending_bytes").value, st.change_feed_pending_bytes);
  EXPECT_EQ(one(samples, "tidal_db_journal").value, 1u);
  EXPECT_EQ(one(samples, "tidal_db_journal_last_seq").value, 1u);  // the leave
  EXPECT_EQ(one(samples, "tidal_db_journal_confirmed_seq").value, 0u);
  EXPECT_EQ(one(samples, "tidal_db_journal_pending_entries").value, 1u);
  EXPECT_EQ(one(samples, "tidal_db_journal_pending_bytes").value, st.journal_pending_bytes);
  EXPECT_EQ(st.journal_pending_bytes, 26u);
  EXPECT_EQ(one(samples, "tidal_db_journal_wait_timeouts_total").value, 0u);
  EXPECT_EQ(one(samples, "tidal_db_ledger_check_records_read").value, 0u);  // no check runs
  EXPECT_EQ(one(samples, "tidal_db_ledger_check_records_estimate").value, 0u);
  EXPECT_EQ(one(samples, "tidal_db_ledger_check_restarts_total").value, 0u);
}

TEST(Metrics, AViewsProgressRendersOneSamplePerShard) {
  const std::vector<ShardProgress> shards = {{1, 10, ""}, {3, 2, ""}, {18446744073709551615u, 5, ""}};
  Result<std::string> text = prometheus_text(shards, {{"view", "global"}});
  ASSERT_OK(text.status());
  const std::vector<Sample> samples = parse(*text);
  ASSERT_FALSE(::testing::Test::HasFailure()) << *text;
  EXPECT_EQ(one(samples, "tidal_view_shards").value, 3u);
  std::map<std::string, std::uint64_t> applied;
  for (const Sample& s : samples) {
    if (s.name != "tidal_view_applied_seq") continue;
    ASSERT_EQ(s.labels.size(), 2u);
    EXPECT_EQ(s.labels[0], (std::pair<std::string, std::string>{"view", "global"}));
    applied[s.labels[1].second] = s.value;
  }
  EXPECT_EQ(applied, (std::map<std::string, std::uint64_t>{{"1", 10}, {"3", 2}, {"18446744073709551615", 5}}));
}

TEST(Metrics, BadLabelsAndNamesAreRefusedNamingThem) {
  const Stats st;
  for (const MetricLabels& bad : {MetricLabels{{"1shard", "x"}}, MetricLabels{{"__name__", "x"}},
                                  MetricLabels{{"sha-rd", "x"}}, MetricLabels{{"", "x"}},
                                  MetricLabels{{"db", "a"}, {"db", "b"}}}) {
    Result<std::string> text = prometheus_text(st, bad);
    ASSERT_EQ(text.status().code(), StatusCode::InvalidArgument) << bad.front().first;
    EXPECT_NE(text.status().message().find("'" + bad.front().first + "'"), std::string::npos)
        << text.status().message();
  }
  // A shard label on every sample of a view clashes with the per-shard one.
  Result<std::string> clash = prometheus_text(std::vector<ShardProgress>{{1, 1, ""}}, {{"shard", "x"}});
  EXPECT_EQ(clash.status().code(), StatusCode::InvalidArgument);
  Result<PrometheusText> builder = PrometheusText::with_labels({});
  ASSERT_OK(builder.status());
  EXPECT_EQ(builder->sample(1).code(), StatusCode::InvalidArgument);  // no family yet
  EXPECT_EQ(builder->family("host_requests", "counter", "x").code(), StatusCode::InvalidArgument);  // no _total
  EXPECT_EQ(builder->family("host_queue_total", "gauge", "x").code(), StatusCode::InvalidArgument);
  EXPECT_EQ(builder->family("9lives", "gauge", "x").code(), StatusCode::InvalidArgument);
  EXPECT_EQ(builder->family("host_queue", "histogram", "x").code(), StatusCode::InvalidArgument);
  ASSERT_OK(builder->family("host_queue", "gauge", "A host's own gauge,\nnext to tidal's."));
  ASSERT_OK(builder->sample(4, {{"queue", "in"}}));
  const std::vector<Sample> samples = parse(builder->text());
  EXPECT_EQ(one(samples, "host_queue").value, 4u);
}

}  // namespace
}  // namespace tidal
