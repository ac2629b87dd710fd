// Test helper for the tidalctl CLI tests: opens a tidal Db read-write
// (creating it), optionally seeds it, prints "ready" and holds the Db open
// until its stdin reaches end of file, then closes it.
//
//   db_holder PATH          hold the Db (create it if missing)
//   db_holder PATH --seed   first join users 1..5 to communities, make users
//                           2 and 3 leave and user 3 rejoin
//   db_holder PATH [--seed] --feed SHARD
//                           the same with the change feed on (shard SHARD);
//                           with --seed user 4 also signals item 1 (cohort 7)
//   db_holder PATH [--seed] [--feed SHARD] --journal
//                           the same with the privacy journal on (the feed's
//                           shard, or 0)
#include <tidal/db.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <string_view>

namespace {

int fail(const char* what, const tidal::Status& s) {
  std::fprintf(stderr, "db_holder: %s: %s\n", what, s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: db_holder PATH [--seed] [--feed SHARD] [--journal]\n");
    return 2;
  }
  bool seed = false;
  tidal::Options options;
  for (int i = 2; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--seed") {
      seed = true;
    } else if (arg == "--journal") {
      options.journal = true;
    } else if (arg == "--feed" && i + 1 < argc) {
      options.change_feed = true;
      options.shard_id = std::stoull(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: db_holder PATH [--seed] [--feed SHARD] [--journal]\n");
      return 2;
    }
  }
  tidal::Result<std::unique_ptr<tidal::Db>> db = tidal::Db::open(argv[1], options);
  if (!db.ok()) return fail("open", db.status());
  if (seed) {
    for (std::uint64_t u = 1; u <= 5; ++u) {
      if (tidal::Status s = (*db)->join_community(u, 100 + u % 2); !s.ok()) return fail("join", s);
      if (tidal::Status s = (*db)->join_community(u, 200); !s.ok()) return fail("join", s);
    }
    for (std::uint64_t u : {std::uint64_t{2}, std::uint64_t{3}}) {
      if (tidal::Status s = (*db)->leave_community_layer(u); !s.ok()) return fail("leave", s);
    }
    if (tidal::Status s = (*db)->rejoin_community_layer(3); !s.ok()) return fail("rejoin", s);
    if (options.change_feed) {
      auto out = (*db)->signal_with_context({4, 1, 2.5}, {{7}});
      if (!out.ok()) return fail("signal", out.status());
    }
  }
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  if (tidal::Status s = (*db)->close(); !s.ok()) return fail("close", s);
  return 0;
}
