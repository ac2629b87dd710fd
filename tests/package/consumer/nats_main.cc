// Links tidal::nats from the package: a Publisher refuses a Db without a
// change feed and a bad config with InvalidArgument (no server needed).
#include <cstdio>
#include <string>

#include <tidal/nats.h>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  auto db = tidal::Db::open(argv[1]);
  if (!db.ok()) return std::printf("open: %s\n", db.status().to_string().c_str()), 1;
  auto p = tidal::nats::Publisher::start(db->get(), tidal::nats::Config{});
  if (p.ok() || p.status().code() != tidal::StatusCode::InvalidArgument) return 1;
  tidal::nats::Config bad;
  bad.replicas = 0;
  auto q = tidal::nats::Publisher::start(db->get(), bad);
  if (q.ok() || q.status().message().find("replicas") == std::string::npos) return 1;
  std::printf("nats_consumer: ok (%s)\n", p.status().to_string().c_str());
  return 0;
}
