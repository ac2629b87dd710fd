// A separate process for the G8 tests: opens a tidal Db and reports.
//   open_probe PATH            opens, prints the Status, exits 0 on OK, 1 otherwise
//   open_probe PATH --hold MS  opens, prints "held", keeps it open for MS milliseconds
//   open_probe PATH --as-nobody  drops root to uid/gid 65534 first (unwritable-directory case)
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>

#include "tidal/db.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: open_probe PATH [--hold MS] [--as-nobody]\n";
    return 2;
  }
  long hold_ms = 0;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--hold") == 0 && i + 1 < argc) hold_ms = std::atol(argv[++i]);
    if (std::strcmp(argv[i], "--as-nobody") == 0 && getuid() == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) {
        std::perror("dropping privileges");
        return 3;
      }
    }
  }
  auto db = tidal::Db::open(argv[1]);
  if (!db.ok()) {
    std::cout << db.status().to_string() << std::endl;
    return 1;
  }
  std::cout << (hold_ms > 0 ? "held" : "Ok") << std::endl;
  std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
  return (*db)->close().ok() ? 0 : 1;
}
