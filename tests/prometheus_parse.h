// A strict reader of the Prometheus text format (0.0.4) for tests: the
// metrics of a Db and a view (metrics_test.cc) and of tidal::nats
// (nats/nats_test.cc) parse by the same rules.
#ifndef TIDAL_TESTS_PROMETHEUS_PARSE_H_
#define TIDAL_TESTS_PROMETHEUS_PARSE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tidal/metrics.h"

namespace tidal::testing {

struct Sample {
  std::string name;
  MetricLabels labels;
  std::uint64_t value = 0;
};

inline bool name_ok(const std::string& name, bool colon) {
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
inline std::vector<Sample> parse(const std::string& text) {
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
inline Sample one(const std::vector<Sample>& samples, const std::string& name) {
  std::vector<Sample> found;
  for (const Sample& s : samples) {
    if (s.name == name) found.push_back(s);
  }
  EXPECT_EQ(found.size(), 1u) << name;
  return found.empty() ? Sample{} : found.front();
}

}  // namespace tidal::testing

#endif  // TIDAL_TESTS_PROMETHEUS_PARSE_H_
