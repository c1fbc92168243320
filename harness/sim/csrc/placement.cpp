// Which process a sim device belongs to, and what the processes sharing one share (see
// harness/sim/placement.py for the switches and the cost model).
//
// A young accelerator belongs to one process: the first that uses it holds it until it exits, and a
// second gets "in use by process N" at its first use. With PORTHARNESS_SIM_SHARING=shared a device takes
// several processes (tenants): its memory is one budget and its kernels take turns.
//
// Everything lives in kernel objects tied to the processes, so a process that dies (kill -9 included)
// releases what it held and nothing is left in files or /dev/shm:
// - ownership: each tenant binds an abstract Unix socket named after the device, its mode and its pid
//   (`portharness-sim:<ns>:d<physical>:t:<x|s>:<pid>`); the kernel drops the name when the process dies.
//   The tenants of a device are the names /proc/net/unix lists. Joining is serialised by a second name
//   (`...:join`), bound for the few milliseconds a join takes.
// - a shared device's ledger (memory limit, bytes per tenant, the turn lock): a memfd each tenant maps and
//   keeps open; a newcomer opens it through a live tenant's /proc/<pid>/fd. Its locks are robust
//   process-shared mutexes: a tenant killed while holding one does not wedge the others. A dead tenant's
//   bytes are reaped (its pid gone, or reused by a process that started later) when they stand in the way.
#include "sim.h"

#include <c10/util/Exception.h>

#include <array>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#endif

namespace sim {
namespace {

constexpr int kMaxTenants = 64;
constexpr uint64_t kMagic = 0x706c616365343501ull;  // "place45", layout 1
constexpr auto kJoinWait = std::chrono::seconds(10);  // a join takes milliseconds; a stuck joiner is named

// Same variables as harness/sim/placement.py.
const char* const kSharingEnv = "PORTHARNESS_SIM_SHARING";
const char* const kNamespaceEnv = "PORTHARNESS_SIM_NAMESPACE";

struct Fraction {
  std::atomic<double> value{1.0};
};
std::array<Fraction, kMaxDevices> fractions;  // the per-process memory fraction of each device (1: none)

std::string format_mib(int64_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(n) / (1 << 20));
  return buf;
}

}  // namespace

void set_fraction(int dev, double f) { fractions.at(dev).value.store(f); }

double fraction(int dev) { return fractions.at(dev).value.load(); }

#ifdef __linux__
namespace {

struct Slot {
  int32_t pid;
  int32_t unused;
  uint64_t start;  // the process's start time (/proc/<pid>/stat): a reused pid is not the tenant
  int64_t bytes;
};

struct Ledger {
  uint64_t magic;
  pthread_mutex_t lock;  // guards limit, used and the slots
  pthread_mutex_t turn;  // held while a kernel runs: one kernel at a time on the device
  int64_t limit;
  int64_t used;
  Slot slots[kMaxTenants];
};

struct Claim {
  std::atomic<bool> done{false};
  int physical = -1;
  bool shared = false;
  Ledger* ledger = nullptr;
  int slot = -1;
  int sock = -1;   // the tenant's name, held for the process's life
  int memfd = -1;  // kept open so that newcomers can open the ledger through /proc/<pid>/fd
};

std::mutex claim_mutex;
std::array<Claim, kMaxDevices> claims;

std::string name_space() {
  const char* raw = std::getenv(kNamespaceEnv);
  std::string ns = raw != nullptr && *raw != '\0' ? raw : "uid" + std::to_string(getuid());
  bool plain = ns.size() <= 40;
  for (char c : ns) plain = plain && (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.');
  if (plain) return ns;
  uint64_t h = 1469598103934665603ull;  // FNV-1a: any namespace text becomes a short, safe name
  for (char c : ns) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  char buf[24];
  std::snprintf(buf, sizeof buf, "h%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string base_name(int phys) { return "portharness-sim:" + name_space() + ":d" + std::to_string(phys); }

// An abstract Unix socket bound to `name` (no file anywhere); -1 with errno when the name is taken.
int bind_abstract(const std::string& name) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof(addr.sun_path) - 1);
  std::memcpy(addr.sun_path + 1, name.data(), n);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n)) != 0 ||
      listen(fd, 4) != 0) {
    int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

// The pid that holds the abstract name (its listener's credentials), or 0.
int holder_of(const std::string& name) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return 0;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof(addr.sun_path) - 1);
  std::memcpy(addr.sun_path + 1, name.data(), n);
  int pid = 0;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n)) == 0) {
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) pid = cred.pid;
  }
  close(fd);
  return pid;
}

struct Tenant {
  int pid;
  char mode;  // 'x' exclusive, 's' shared
};

// The device's tenants: the names bound under `base` (listed by /proc/net/unix, '@' for the leading NUL).
std::vector<Tenant> tenants_of(const std::string& base) {
  std::vector<Tenant> out;
  std::ifstream in("/proc/net/unix");
  std::string line;
  const std::string prefix = "@" + base + ":t:";
  while (std::getline(in, line)) {
    size_t at = line.find(prefix);
    if (at == std::string::npos) continue;
    std::string rest = line.substr(at + prefix.size());  // "<mode>:<pid>"
    if (rest.size() < 3 || rest[1] != ':') continue;
    int pid = std::atoi(rest.c_str() + 2);
    if (pid > 0 && pid != getpid()) out.push_back({pid, rest[0]});
  }
  return out;
}

uint64_t start_time(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t close_paren = text.rfind(')');
  if (close_paren == std::string::npos) return 0;
  std::istringstream fields(text.substr(close_paren + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

bool alive(const Slot& s) {
  if (s.pid <= 0) return false;
  if (kill(s.pid, 0) != 0 && errno == ESRCH) return false;
  uint64_t now = start_time(s.pid);
  return now == 0 || s.start == 0 || now == s.start;
}

void lock_robust(pthread_mutex_t* m, Ledger* ledger) {
  int rc = pthread_mutex_lock(m);
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(m);
    if (ledger != nullptr && m == &ledger->lock) {  // its holder died mid-update: recount
      ledger->used = 0;
      for (const Slot& s : ledger->slots) ledger->used += s.pid > 0 ? s.bytes : 0;
    }
  }
}

struct LedgerLock {
  Ledger* l;
  explicit LedgerLock(Ledger* ledger) : l(ledger) { lock_robust(&l->lock, l); }
  ~LedgerLock() { pthread_mutex_unlock(&l->lock); }
};

void reap(Ledger* l) {
  for (Slot& s : l->slots) {
    if (s.pid > 0 && !alive(s)) {
      l->used -= s.bytes;
      s = Slot{};
    }
  }
}

void init_mutex(pthread_mutex_t* m) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(m, &attr);
  pthread_mutexattr_destroy(&attr);
}

Ledger* map_ledger(int fd) {
  void* p = mmap(nullptr, sizeof(Ledger), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<Ledger*>(p);
}

// The ledger memfd a live tenant holds, opened through its fd table; -1 if none could be.
int open_ledger(const std::vector<Tenant>& tenants, const std::string& base) {
  const std::string want = "/memfd:" + base + " (deleted)";
  for (const Tenant& t : tenants) {
    std::string dir = "/proc/" + std::to_string(t.pid) + "/fd";
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) continue;
    int found = -1;
    while (dirent* e = readdir(d)) {
      std::string path = dir + "/" + e->d_name;
      char target[512];
      ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      if (want == target) {
        found = open(path.c_str(), O_RDWR | O_CLOEXEC);
        if (found >= 0) break;
      }
    }
    closedir(d);
    if (found >= 0) return found;
  }
  return -1;
}

std::string pids_text(const std::vector<Tenant>& tenants) {
  std::string out;
  for (size_t i = 0; i < tenants.size(); ++i) out += (i ? ", " : "") + std::to_string(tenants[i].pid);
  return out;
}

[[noreturn]] void refuse(int dev, const std::vector<Tenant>& holders, bool want_shared) {
  bool exclusive_holder = false;
  for (const Tenant& t : holders) exclusive_holder = exclusive_holder || t.mode == 'x';
  std::string who = holders.size() == 1 ? "process " + pids_text(holders) : "processes " + pids_text(holders);
  std::string why = exclusive_holder || !want_shared
      ? "sim's devices are exclusive: a device belongs to the first process that uses it, until that process "
        "exits; set PORTHARNESS_SIM_SHARING=shared in every process that should share it"
      : "they share it, and this process asked for it alone (PORTHARNESS_SIM_SHARING is not 'shared' here)";
  if (want_shared && exclusive_holder) {
    why = "it holds the device exclusively (its PORTHARNESS_SIM_SHARING is not 'shared')";
  }
  TORCH_CHECK(false, device_label(dev), " is in use by ", who, " (", why, ")");
  __builtin_unreachable();
}

int64_t limit_of(int dev) { return memory_stats(dev).limit; }

// First use of logical device `dev` by this process.
void claim_slow(int dev) {
  std::lock_guard<std::mutex> guard(claim_mutex);
  Claim& c = claims[dev];
  if (c.done.load()) return;
  const int phys = physical_index(dev);
  const std::string base = base_name(phys);
  const char* mode_env = std::getenv(kSharingEnv);
  const bool want_shared = mode_env != nullptr && std::string(mode_env) == "shared";

  auto started = std::chrono::steady_clock::now();
  int join = -1;
  while ((join = bind_abstract(base + ":join")) < 0) {
    TORCH_CHECK(errno == EADDRINUSE, "sim: cannot take ", device_label(dev), ": ", std::strerror(errno));
    if (std::chrono::steady_clock::now() - started > kJoinWait) {
      TORCH_CHECK(false, device_label(dev), " is being taken by process ", holder_of(base + ":join"),
                  ", which has not finished after ", kJoinWait.count(), " s (is it stopped?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  struct Release {
    int fd;
    ~Release() { close(fd); }
  } release{join};

  std::vector<Tenant> holders = tenants_of(base);
  if (!want_shared && !holders.empty()) refuse(dev, holders, false);
  for (const Tenant& t : holders) {
    if (t.mode != 's') refuse(dev, {t}, true);
  }
  Ledger* ledger = nullptr;
  int memfd = -1;
  int slot = -1;
  if (want_shared) {
    memfd = holders.empty() ? -1 : open_ledger(holders, base);
    bool fresh = memfd < 0;
    if (fresh) {  // the first tenant (or every earlier one has gone meanwhile)
      memfd = memfd_create(base.c_str(), MFD_CLOEXEC);
      TORCH_CHECK(memfd >= 0 && ftruncate(memfd, sizeof(Ledger)) == 0, "sim: cannot share ", device_label(dev), ": ",
                  std::strerror(errno));
    }
    ledger = map_ledger(memfd);
    TORCH_CHECK(ledger != nullptr, "sim: cannot map the ledger of ", device_label(dev), ": ", std::strerror(errno));
    if (fresh) {
      init_mutex(&ledger->lock);
      init_mutex(&ledger->turn);
      ledger->limit = limit_of(dev);
      ledger->magic = kMagic;
    }
    TORCH_CHECK(ledger->magic == kMagic, "sim: the ledger of ", device_label(dev), " is another version's");
    LedgerLock lock(ledger);
    reap(ledger);
    for (int i = 0; i < kMaxTenants && slot < 0; ++i) {
      if (ledger->slots[i].pid == 0) slot = i;
    }
    TORCH_CHECK(slot >= 0, device_label(dev), " already has ", kMaxTenants, " processes sharing it");
    ledger->slots[slot] = Slot{getpid(), 0, start_time(getpid()), 0};
  }
  int sock = bind_abstract(base + ":t:" + (want_shared ? "s:" : "x:") + std::to_string(getpid()));
  TORCH_CHECK(sock >= 0, "sim: cannot register as a user of ", device_label(dev), ": ", std::strerror(errno));
  c.physical = phys;
  c.shared = want_shared;
  c.ledger = ledger;
  c.slot = slot;
  c.sock = sock;
  c.memfd = memfd;
  if (ledger != nullptr) set_memory_limit(dev, ledger->limit);  // the device's size is the first tenant's
  c.done.store(true);
}

thread_local int turn_depth = 0;

}  // namespace

void claim(int dev) {
  if (dev < 0 || dev >= kMaxDevices || claims[dev].done.load(std::memory_order_acquire)) return;
  claim_slow(dev);
}

bool claimed(int dev) noexcept { return dev >= 0 && dev < kMaxDevices && claims[dev].done.load(); }

bool shared(int dev) noexcept { return claimed(dev) && claims[dev].shared; }

bool ledger_take(int dev, int64_t bytes) {
  Ledger* l = claims[dev].ledger;
  LedgerLock lock(l);
  if (l->used + bytes > l->limit) {
    reap(l);
    if (l->used + bytes > l->limit) return false;
  }
  l->used += bytes;
  l->slots[claims[dev].slot].bytes += bytes;
  return true;
}

void ledger_give(int dev, int64_t bytes) {
  Ledger* l = claims[dev].ledger;
  LedgerLock lock(l);
  l->used -= bytes;
  l->slots[claims[dev].slot].bytes -= bytes;
}

void ledger_set_limit(int dev, int64_t bytes) {
  if (!shared(dev)) return;
  LedgerLock lock(claims[dev].ledger);
  claims[dev].ledger->limit = bytes;
}

std::pair<int64_t, int64_t> shared_info(int dev) {
  Ledger* l = claims[dev].ledger;
  LedgerLock lock(l);
  reap(l);
  return {l->used, l->limit};
}

std::vector<std::pair<int, int64_t>> ledger_tenants(int dev) {
  std::vector<std::pair<int, int64_t>> out;
  if (!shared(dev)) return out;
  Ledger* l = claims[dev].ledger;
  LedgerLock lock(l);
  reap(l);
  for (const Slot& s : l->slots) {
    if (s.pid > 0) out.emplace_back(s.pid, s.bytes);
  }
  return out;
}

std::vector<std::pair<int, std::string>> holders(int physical) {
  std::vector<std::pair<int, std::string>> out;
  for (int d = 0; d < kMaxDevices; ++d) {  // this process (tenants_of lists the others)
    if (claims[d].done.load() && claims[d].physical == physical) {
      out.emplace_back(getpid(), claims[d].shared ? "shared" : "exclusive");
    }
  }
  for (const Tenant& t : tenants_of(base_name(physical))) out.emplace_back(t.pid, t.mode == 's' ? "shared" : "exclusive");
  return out;
}

Turn::Turn(int dev) {
  if (turn_depth++ == 0 && shared(dev)) {
    lock_ = &claims[dev].ledger->turn;
    lock_robust(static_cast<pthread_mutex_t*>(lock_), nullptr);
  }
}

Turn::~Turn() {
  if (lock_ != nullptr) pthread_mutex_unlock(static_cast<pthread_mutex_t*>(lock_));
  --turn_depth;
}

std::string oom_context(int dev, size_t bytes, int64_t own, int64_t limit) {
  double f = fraction(dev);
  if (f < 1.0 && own + static_cast<int64_t>(bytes) > static_cast<int64_t>(f * static_cast<double>(limit))) {
    return "This process may use " + format_mib(static_cast<int64_t>(f * static_cast<double>(limit))) + " of " +
           device_label(dev) + " (set_per_process_memory_fraction(" + std::to_string(f) + ")) and has " +
           format_mib(own) + " allocated by tensors";
  }
  if (!shared(dev)) return "";
  std::string out;
  for (const auto& [pid, b] : ledger_tenants(dev)) {
    if (pid != getpid()) out += "Process " + std::to_string(pid) + " has " + format_mib(b) + " memory in use. ";
  }
  return out + "Of the allocated memory " + format_mib(own) + " is allocated by this process's tensors (" +
         device_label(dev) + " is shared: its memory is one budget across the processes using it)";
}

#else  // no ownership model outside Linux: every process has every device to itself

void claim(int) {}
bool claimed(int) noexcept { return false; }
bool shared(int) noexcept { return false; }
bool ledger_take(int, int64_t) { return true; }
void ledger_give(int, int64_t) {}
void ledger_set_limit(int, int64_t) {}
std::pair<int64_t, int64_t> shared_info(int) { return {0, 0}; }
std::vector<std::pair<int, int64_t>> ledger_tenants(int) { return {}; }
std::vector<std::pair<int, std::string>> holders(int) { return {}; }
Turn::Turn(int) {}
Turn::~Turn() {}
std::string oom_context(int dev, size_t bytes, int64_t own, int64_t limit) {
  double f = fraction(dev);
  if (f < 1.0 && own + static_cast<int64_t>(bytes) > static_cast<int64_t>(f * static_cast<double>(limit))) {
    return "This process may use " + format_mib(static_cast<int64_t>(f * static_cast<double>(limit))) + " of " +
           device_label(dev) + " (set_per_process_memory_fraction(" + std::to_string(f) + "))";
  }
  return "";
}

#endif

}  // namespace sim
