// Helper threads that stay awake between kernel calls.
//
// A decode step calls the kernels hundreds of times, tens of microseconds
// apart (eight calls per layer at one row). Handing a call's work items to
// XLA's thread pool wakes a sleeping pool thread each time, which costs tens
// of microseconds (more on a virtual machine, where waking an idle vCPU is an
// interrupt into the host), so small calls ran on the calling thread alone
// and left the other cores idle. A crew's helpers instead wait for the next
// call by spinning (with a pause, yielding the core now and then to whatever
// else is runnable there) for kIdleSpin after their last work, then sleep. A
// call in a dense run of calls therefore reaches a helper through one cache
// line, and a call after a pause costs what the pool costs.
//
// One crew per library, created on the first call that lends work. Work is a
// callable that any number of threads may run at once and late: it takes its
// items from its own counter, so a helper that arrives after the items are
// gone finds nothing to do. Only one call at a time holds the crew; a second
// concurrent call (steps of several devices in one process) gets false from
// Lend and uses XLA's pool instead.

#ifndef JAX_LLM_RUNTIME_NATIVE_WORKER_CREW_H_
#define JAX_LLM_RUNTIME_NATIVE_WORKER_CREW_H_

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

namespace worker_crew {

// How long a helper spins for the next call after its last work.
constexpr std::chrono::microseconds kIdleSpin{300};

inline void CrewPause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Crew {
 public:
  // The library's crew of `helpers` threads (the count of the first call
  // decides); nullptr when helpers < 1 or RUNTIME_NATIVE_CREW=0.
  static Crew* Get(int helpers) {
    static Crew* crew = [helpers]() -> Crew* {
      const char* env = std::getenv("RUNTIME_NATIVE_CREW");
      if (helpers < 1 || (env != nullptr && std::strcmp(env, "0") == 0)) return nullptr;
      return new Crew(helpers);  // never freed: its threads live as long as the process
    }();
    return crew;
  }

  // Hands `work` to the helpers; false when another call holds the crew.
  bool Lend(std::function<void()> work) {
    if (busy_.exchange(true)) return false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      work_ = std::move(work);
    }
    epoch_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    return true;
  }

  // After a lent call's work is done: the crew is free for the next call.
  void Return() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      work_ = nullptr;
    }
    busy_.store(false);
  }

  int helpers() const { return helpers_; }

 private:
  explicit Crew(int helpers) : helpers_(helpers) {
    for (int i = 0; i < helpers; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    uint64_t seen = epoch_.load();
    for (;;) {
      seen = WaitPast(seen);
      std::function<void()> work;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        work = work_;
      }
      if (work) work();
    }
  }

  // Spins until the epoch moves past `seen` or kIdleSpin has passed, then
  // sleeps until it moves; returns the new epoch.
  uint64_t WaitPast(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + kIdleSpin;
    for (uint32_t spins = 1;; ++spins) {
      const uint64_t now = epoch_.load();
      if (now != seen) return now;
      CrewPause();
      if (spins % 64 != 0) continue;
      if (std::chrono::steady_clock::now() < until) {
        sched_yield();  // let a runnable thread of this core in
        continue;
      }
      std::unique_lock<std::mutex> lock(mutex_);
      sleepers_.fetch_add(1);
      wake_.wait(lock, [&] { return epoch_.load() != seen; });
      sleepers_.fetch_sub(1);
      return epoch_.load();
    }
  }

  const int helpers_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::function<void()> work_;  // the lent call's work (under mutex_)
};

}  // namespace worker_crew

#endif  // JAX_LLM_RUNTIME_NATIVE_WORKER_CREW_H_
