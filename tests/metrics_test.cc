// Metrics in the Prometheus text format (include/tidal/metrics.h): the text
// parses by the exposition format's rules, each sample carries its labels
// (escaped and read back), and each value is the field of stats() it names.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"
#include "tidal/db.h"
#include "tidal/global_view.h"
#include "tidal/metrics.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::TempDir;

struct Sample {
  std::string name;
  MetricLabels labels;
  std::uint64_t value = 0;
};

bool name_ok(const std::string& name, bool colon) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Parses `text` by the exposition format (0.0.4), failing the test at the
// first line that breaks it: each family is "# HELP name ...", then
// "# TYPE name counter|gauge", then its samples; a counter's name ends in
// _total; label values are read back unescaped.
std::vector<Sample> parse(const std::string& text) {
  std::vector<Sample> out;
  std::map<std::string, std::string> types;
  std::string help_of, family;
  std::size_t pos = 0;
  int line_no = 0;
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "the text must end with a newline";
  while (pos < text.size()) {
    const std::size_t end = text.find('\n', pos);
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    const std::string where = "line " + std::to_string(line_no) + ": '" + line + "'";
    if (line.starts_with("# HELP ")) {
      help_of = line.substr(7, line.find(' ', 7) - 7);
      EXPECT_TRUE(name_ok(help_of, true)) << where;
      EXPECT_EQ(types.count(help_of), 0u) << where << ": a family given twice";
      continue;
    }
    if (line.starts_with("# TYPE ")) {
      const std::size_t space = line.find(' ', 7);
      family = line.substr(7, space - 7);
      const std::string type = line.substr(space + 1);
      EXPECT_EQ(family, help_of) << where << ": TYPE without its HELP";
      EXPECT_TRUE(type == "counter" || type == "gauge") << where;
      EXPECT_EQ(type == "counter", family.ends_with("_total")) << where;
      types[family] = type;
      continue;
    }
    if (line.starts_with("#")) {
      ADD_FAILURE() << where << ": a comment that is neither HELP nor TYPE";
      continue;
    }
    Sample s;
    std::size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = line.substr(0, i);
    EXPECT_EQ(s.name, family) << where << ": a sample outside its family";
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const std::size_t eq = line.find('=', i);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          ADD_FAILURE() << where << ": malformed label";
          return out;
        }
        const std::string label = line.substr(i, eq - i);
        EXPECT_TRUE(name_ok(label, false)) << where;
        std::string value;
        std::size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        s.labels.emplace_back(label, value);
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      ++i;  // '}'
    }
    if (i >= line.size() || line[i] != ' ') {
      ADD_FAILURE() << where << ": no value";
      return out;
    }
    const std::string number = line.substr(i + 1);
    EXPECT_FALSE(number.empty()) << where;
    EXPECT_EQ(number.find_first_not_of("0123456789"), std::string::npos) << where;
    s.value = number.empty() ? 0 : std::stoull(number);
    out.push_back(std::move(s));
  }
  return out;
}

// The one sample of `name`; fails the test when there is not exactly one.
Sample one(const std::vector<Sample>& samples, const std::string& name) {
  std::vector<Sample> found;
  for (const Sample& s : samples) {
    if (s.name == name) found.push_back(s);
  }
  EXPECT_EQ(found.size(), 1u) << name;
  return found.empty() ? Sample{} : found.front();
}

TEST(Metrics, ADbsStatsRenderAsPrometheusTextWithEveryValueAndLabel) {
  TempDir dir;
  Options options;
  options.change_feed = true;
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
  EXPECT_EQ(samples.size(), 29u);
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
  EXPECT_EQ(one(samples, "tidal_db_change_feed").value, 1u);
  EXPECT_EQ(one(samples, "tidal_db_change_feed_last_seq").value, st.change_feed_last_seq);
  EXPECT_GE(st.change_feed_last_seq, 1u);
  EXPECT_EQ(one(samples, "tidal_db_change_feed_pending_bytes").value, st.change_feed_pending_bytes);
}

TEST(Metrics, AViewsProgressRendersOneSamplePerShard) {
  const std::vector<ShardProgress> shards = {{1, 10}, {3, 2}, {18446744073709551615u, 5}};
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
  Result<std::string> clash = prometheus_text(std::vector<ShardProgress>{{1, 1}}, {{"shard", "x"}});
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
