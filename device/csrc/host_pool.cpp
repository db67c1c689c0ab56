// The device worker's host memory: a caching pool for the bytes its kernels allocate.
//
// The simulated device's memory is host memory. The device worker runs CPU kernels, whose
// outputs ATen allocates through the CPU allocator, and glibc gives a thread other than the
// main one an arena of its own, made of 64 MiB heaps that it unmaps as soon as one is empty
// (whatever M_TRIM_THRESHOLD says: arena.c, heap_trim). A step that allocates more than a
// heap at once (a multi-tensor optimizer's temporaries: 25 MiB of `_foreach_sqrt` for a
// 6.3 M-parameter model) maps a fresh heap and faults in every page of it, every step:
// measured 7000-8000 page faults and 20 ms of system time in a 290 ms Llama training step
// in strict eager, none in the same step in CPU eager (bench/realtime.py's Llama, one
// thread). A device runtime keeps its memory instead (CUDA's caching allocator; the Neuron
// runtime allocates from a pool it reserves), and so does this pool, for the worker only.
//
// How: a CPU allocator installed over the current one (c10::SetCPUAllocator, a higher
// priority) when the first device worker starts. On a worker thread (`on_worker`), a
// block of at least kMinBytes comes from the pool: a cached block of at least the size
// asked and at most an eighth (and a page) more, else a new one (c10::alloc_cpu, the
// CPU allocator's own). Any thread frees it: it goes back to the cache, the oldest cached
// blocks freed while the cache holds more than the larger of kMinLimit and the most the pool
// ever had in use (so a workload's steady state allocates nothing, and a workload whose
// sizes drift, a growing KV cache, does not keep stale blocks). Every other allocation,
// and all of them on other threads, is the allocator's it replaced, untouched.
// `torch.neuron.empty_cache()` frees the cache (release_host_pool).
//
// A worker may also reserve blocks before a run of kernels (reserve_host_blocks): taken from
// the cache or made now, they serve that thread's next allocations of their sizes, so a run
// whose every large allocation was reserved cannot run out of memory once it has started
// (executor.cpp: a multi-tensor run parameter by parameter); release_host_reservation
// returns what the run did not use.

#include "neuron.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <pthread.h>

#include <list>
#include <map>
#include <mutex>
#include <unordered_map>

namespace neuron {
namespace {

// Below this a block is the replaced allocator's: glibc serves small blocks from its bins
// without faults (an assumption of this pool, not a measured threshold).
constexpr size_t kMinBytes = 64 * 1024;
// The cache may always hold this much (an assumption: enough for the bench's models'
// per-step temporaries; the limit also grows with the most the pool had in use).
constexpr size_t kMinLimit = 256ull << 20;
constexpr size_t kPage = 4096;

// Does a block of `size` bytes serve a request for `nbytes` (at most an eighth and a page more)?
bool serves(size_t size, size_t nbytes) {
  return size >= nbytes && size <= nbytes + nbytes / 8 + kPage;
}

thread_local bool on_worker = false;
// Blocks reserved for this worker's next allocations (reserve_host_blocks): (size, block).
thread_local std::vector<std::pair<size_t, void*>> reserved;

struct Pool {
  std::mutex mutex;
  struct Cached {
    std::multimap<size_t, void*>::iterator by_size;
    std::list<void*>::iterator by_age;
  };
  std::unordered_map<void*, size_t> sizes;  // every block of the pool (in use or cached)
  std::multimap<size_t, void*> free_by_size;
  std::list<void*> free_by_age;  // oldest first
  std::unordered_map<void*, Cached> cached;
  size_t in_use = 0;
  size_t peak_in_use = 0;
  size_t cached_bytes = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t releases = 0;  // blocks returned to the C library
  c10::Allocator* replaced = nullptr;

  // A block of at least `nbytes`, or nullptr (a new one is the caller's to make).
  void* take(size_t nbytes) {
    auto found = free_by_size.lower_bound(nbytes);
    if (found == free_by_size.end() || !serves(found->first, nbytes)) {
      return nullptr;
    }
    void* block = found->second;
    uncache(block);
    return block;
  }

  void uncache(void* block) {
    auto entry = cached.find(block);
    free_by_size.erase(entry->second.by_size);
    free_by_age.erase(entry->second.by_age);
    cached_bytes -= sizes[block];
    cached.erase(entry);
  }

  // Blocks to free (outside the lock) so that the cache holds at most `limit` bytes.
  void evict(size_t limit, std::vector<void*>& freed) {
    while (cached_bytes > limit && !free_by_age.empty()) {
      void* block = free_by_age.front();
      uncache(block);
      sizes.erase(block);
      freed.push_back(block);
    }
  }
};

Pool& pool() {
  static Pool* the_pool = new Pool();  // never destroyed: a block may be freed at exit
  return *the_pool;
}

void free_all(const std::vector<void*>& freed) {
  for (void* block : freed) {
    c10::free_cpu(block);
  }
}

void pool_delete(void* data) {
  Pool& p = pool();
  std::vector<void*> freed;
  bool ours = true;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    auto found = p.sizes.find(data);
    ours = found != p.sizes.end();
    if (ours) {
      size_t nbytes = found->second;
      p.in_use -= nbytes;
      // First among the cached blocks of its size, so take() reuses the most recently freed
      // (still in the caches, as glibc's bins would give it), not the oldest.
      auto by_size = p.free_by_size.emplace_hint(p.free_by_size.lower_bound(nbytes), nbytes, data);
      p.free_by_age.push_back(data);
      p.cached.emplace(data, Pool::Cached{by_size, std::prev(p.free_by_age.end())});
      p.cached_bytes += nbytes;
      p.evict(std::max(kMinLimit, p.peak_in_use), freed);
      p.releases += static_cast<int64_t>(freed.size());
    }
  }
  if (!ours) {  // a raw allocation of the replaced allocator (raw_deallocate uses our raw_deleter)
    c10::DeleterFnPtr deleter = p.replaced->raw_deleter();
    if (deleter != nullptr) {
      deleter(data);
    }
    return;
  }
  free_all(freed);
}

// A block of at least `nbytes`, counted in use: a cached one, else a new one
// (c10::alloc_cpu, which throws c10::OutOfMemoryError, as the CPU allocator does).
// `nbytes` becomes the block's size.
void* obtain(size_t& nbytes) {
  Pool& p = pool();
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    block = p.take(nbytes);
    if (block != nullptr) {
      ++p.hits;
      nbytes = p.sizes[block];
      p.in_use += nbytes;
      p.peak_in_use = std::max(p.peak_in_use, p.in_use);
      return block;
    }
  }
  block = c10::alloc_cpu(nbytes);
  std::lock_guard<std::mutex> lock(p.mutex);
  ++p.misses;
  p.sizes.emplace(block, nbytes);
  p.in_use += nbytes;
  p.peak_in_use = std::max(p.peak_in_use, p.in_use);
  return block;
}

struct PoolAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    Pool& p = pool();
    if (!on_worker || nbytes < kMinBytes) {
      return p.replaced->allocate(nbytes);
    }
    for (auto it = reserved.begin(); it != reserved.end(); ++it) {  // (in use since reserved)
      if (serves(it->first, nbytes)) {
        void* block = it->second;
        reserved.erase(it);
        return c10::DataPtr(block, block, &pool_delete, c10::Device(c10::DeviceType::CPU));
      }
    }
    void* block = obtain(nbytes);
    return c10::DataPtr(block, block, &pool_delete, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &pool_delete;  // the pool's blocks, and the replaced allocator's (passed on)
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Never destroyed: c10 keeps pointing at it, and a static destructor at exit may still allocate.
PoolAllocator* const the_pool_allocator = new PoolAllocator();

// A fork (a DataLoader worker) while another thread holds the lock would leave the child's
// lock held forever: the child frees the tensors it inherited.
void lock_for_fork() {
  pool().mutex.lock();
}
void unlock_after_fork() {
  pool().mutex.unlock();
}

}  // namespace

void enter_host_pool() {
  static std::once_flag installed;
  std::call_once(installed, [] {
    pool().replaced = c10::GetCPUAllocator();
    c10::SetCPUAllocator(the_pool_allocator, /*priority=*/1);
    pthread_atfork(&lock_for_fork, &unlock_after_fork, &unlock_after_fork);
  });
  on_worker = true;
}

bool reserve_host_blocks(const std::vector<size_t>& sizes) {
  if (!on_worker || c10::GetCPUAllocator() != the_pool_allocator) {
    return false;
  }
  try {
    reserved.reserve(reserved.size() + sizes.size());  // (no allocation once a block is taken)
    for (size_t nbytes : sizes) {
      if (nbytes < kMinBytes) {
        continue;  // the replaced allocator's (see kMinBytes)
      }
      void* block = obtain(nbytes);
      reserved.emplace_back(nbytes, block);
    }
  } catch (const std::exception&) {
    release_host_reservation();
    return false;
  }
  return true;
}

void release_host_reservation() {
  std::vector<std::pair<size_t, void*>> left;
  left.swap(reserved);
  for (auto& [nbytes, block] : left) {
    pool_delete(block);  // back to the cache
  }
}

void release_host_pool() {
  Pool& p = pool();
  std::vector<void*> freed;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    p.evict(0, freed);
    p.releases += static_cast<int64_t>(freed.size());
  }
  free_all(freed);
}

py::dict host_pool_stats() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  py::dict stats;
  stats["in_use_bytes"] = p.in_use;
  stats["peak_in_use_bytes"] = p.peak_in_use;
  stats["cached_bytes"] = p.cached_bytes;
  stats["hits"] = p.hits;
  stats["misses"] = p.misses;
  stats["releases"] = p.releases;
  stats["installed"] = c10::GetCPUAllocator() == the_pool_allocator;
  return stats;
}

}  // namespace neuron
