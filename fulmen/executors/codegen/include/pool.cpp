
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <pthread.h>
#include <unordered_map>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif

// DLPack's ABI (dlpack.h, v0.8): the struct torch's from_dlpack consumes.
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void* data; DLDevice device; int32_t ndim; DLDataType dtype;
  int64_t* shape; int64_t* strides; uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor; void* manager_ctx; void (*deleter)(DLManagedTensor*);
};

namespace {
const size_t kPage = size_t(1) << 21;  // a transparent huge page
const size_t kSmallPage = size_t(1) << 12;  // a base page: the unit of blocks under kPage
struct Block { DLManagedTensor managed; int64_t shape[16]; size_t capacity; };
std::mutex lock;
std::unordered_map<size_t, std::vector<void*>> free_blocks;  // capacity -> blocks, LIFO
size_t cached = 0, limit = 0, in_use = 0, hits = 0, misses = 0;
// a child forked while another thread held the lock would wait on it forever: it gets a new one
struct ResetAfterFork {
  ResetAfterFork() { pthread_atfork(nullptr, nullptr, [] { new (&lock) std::mutex(); }); }
} reset_after_fork;

void put_back(DLManagedTensor* managed) {
  Block* block = static_cast<Block*>(managed->manager_ctx);
  void* data = managed->dl_tensor.data;
  {
    std::lock_guard<std::mutex> guard(lock);
    in_use -= block->capacity;
    if (cached + block->capacity <= limit) {
      free_blocks[block->capacity].push_back(data);
      cached += block->capacity;
      data = nullptr;
    }
  }
  std::free(data);
  delete block;
}
}  // namespace

extern "C" DLManagedTensor* fulmen_pool_take(int64_t nbytes, int32_t ndim, const int64_t* shape,
                                              uint8_t code, uint8_t bits) {
  if (ndim < 0 || ndim > 16 || nbytes <= 0) return nullptr;
  // blocks of a huge page and more are whole huge pages; smaller ones whole base pages (a
  // 1.5 MiB output in a 2 MiB block would hold a quarter more memory than torch.empty's)
  const size_t unit = size_t(nbytes) >= kPage ? kPage : kSmallPage;
  const size_t capacity = (size_t(nbytes) + unit - 1) / unit * unit;
  void* data = nullptr;
  {
    std::lock_guard<std::mutex> guard(lock);
    auto found = free_blocks.find(capacity);
    if (found != free_blocks.end() && !found->second.empty()) {
      data = found->second.back();
      found->second.pop_back();
      cached -= capacity;
      ++hits;
    } else {
      ++misses;
    }
    in_use += capacity;
  }
  if (data == nullptr) {
    data = std::aligned_alloc(unit, capacity);
    if (data == nullptr) {
      std::lock_guard<std::mutex> guard(lock);
      in_use -= capacity;
      return nullptr;
    }
#ifdef MADV_HUGEPAGE
    if (unit == kPage) madvise(data, capacity, MADV_HUGEPAGE);  // a hint: without THP, nothing
#endif
  }
  Block* block = new Block();
  block->capacity = capacity;
  for (int32_t d = 0; d < ndim; ++d) block->shape[d] = shape[d];
  DLTensor& t = block->managed.dl_tensor;
  t.data = data;
  t.device = DLDevice{1, 0};  // kDLCPU
  t.ndim = ndim;
  t.dtype = DLDataType{code, bits, 1};
  t.shape = block->shape;
  t.strides = nullptr;  // compact row-major
  t.byte_offset = 0;
  block->managed.manager_ctx = block;
  block->managed.deleter = put_back;
  return &block->managed;
}

extern "C" void fulmen_pool_put(DLManagedTensor* managed) { put_back(managed); }

extern "C" void fulmen_pool_set_limit(int64_t bytes) {
  std::lock_guard<std::mutex> guard(lock);
  limit = bytes < 0 ? 0 : size_t(bytes);
}

extern "C" void fulmen_pool_release(int64_t keep) {
  std::vector<void*> release;
  {
    std::lock_guard<std::mutex> guard(lock);
    for (auto& entry : free_blocks) {
      while (!entry.second.empty() && cached > size_t(keep < 0 ? 0 : keep)) {
        release.push_back(entry.second.back());
        entry.second.pop_back();
        cached -= entry.first;
      }
    }
  }
  for (void* data : release) std::free(data);
}

extern "C" void fulmen_pool_stats(int64_t* out) {
  std::lock_guard<std::mutex> guard(lock);
  out[0] = int64_t(cached); out[1] = int64_t(in_use); out[2] = int64_t(limit);
  out[3] = int64_t(hits); out[4] = int64_t(misses);
}
