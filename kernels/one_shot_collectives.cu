// One-shot collectives of bf16 over the two GPUs of one process: an all-reduce (TP mode's
// sums) and an all-to-all (SP mode's exchanges), as XLA FFI custom calls that XLA may record
// into its CUDA graphs (kCmdBufferCompatible).
//
// Why: each NCCL collective splits XLA's CUDA graph of a step, so a TP decode step on two
// H200s launches ~66 graphs and ~66 collectives per GPU and is bound by the host (NCCL's
// kernels themselves take ~12 us each for a decode step's 64 KiB; benchmarks/README.md, "Two GPUs").
// These kernels are plain kernel launches on XLA's stream, with buffers set up once per
// process, so a step can be one graph; the exchange is also quicker than NCCL's at every size
// measured (two H200s; benchmarks/README.md, "Two GPUs").
//
// Protocol of the all-reduce, per call (rank r of 2, its peer p; every block handles one segment):
//   1. write my segment of x into the peer's receive buffer (slot = call parity) over NVLink;
//   2. fence, then raise the peer's flag for (slot, block) to this call's number;
//   3. wait until my own flag for (slot, block) shows the peer's data has arrived;
//   4. out = bf16(float(x) + float(received)): a + b == b + a, so both GPUs hold the same sum
//      (and NCCL's, bit for bit, in the measurements).
// Reuse is safe with two slots: the peer writes slot s of call k + 2 only after my flag of
// call k + 1, which I raise after my call k (and its reads of slot s) finished.
// The call number lives on the device (the graph's arguments are frozen); the last block to
// finish advances it. Flags and numbers are 64-bit, so a tag never wraps to a stale flag.
// The all-to-all follows the same protocol, with the same slots, flags and call number (a copy
// in place of the sum; exchange_kernel). A trap (the peer never arrived) leaves this GPU's
// CUDA context unusable: the process must restart, where NCCL would have hung instead.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// (macros, so that variants can be built and measured; the defaults ship)
#ifndef SHIFTJAX_MAX_BLOCKS
#define SHIFTJAX_MAX_BLOCKS 132
#endif
#ifndef SHIFTJAX_THREADS
#define SHIFTJAX_THREADS 512
#endif
#ifndef SHIFTJAX_EXCHANGE_BATCH
#define SHIFTJAX_EXCHANGE_BATCH 1
#endif
constexpr int kMaxBlocks = SHIFTJAX_MAX_BLOCKS;  // flags per slot; the grid is also capped by what is resident
constexpr int kThreads = SHIFTJAX_THREADS;
constexpr int kMaxDevices = 16;      // CUDA ordinals this process may name

struct DeviceState {               // one per participating device, in its memory
  char* receive = nullptr;         // [2 slots][capacity bytes]
  uint64_t* flags = nullptr;       // [2 slots][kMaxBlocks]: the call number (+1) that filled it
  unsigned long long* counters = nullptr;  // [0]: calls made, [1]: blocks finished in this call
};

std::mutex mutex;
int group[2] = {-1, -1};           // CUDA ordinals of rank 0 and rank 1
size_t capacity = 0;               // bytes per slot
int max_blocks = 0;                // blocks that can all be resident at once on both GPUs
DeviceState states[2];
std::string last_error;

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void store_release(uint64_t* address, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A peer that never arrives (its step failed, or it runs other code) must not hang the
// process silently: after this long the kernel traps, and XLA reports a CUDA error.
constexpr uint64_t kPeerTimeoutNs = 20ull * 1000 * 1000 * 1000;

// Thread 0 of a block: wait until the peer's block of the same index has raised my flag of
// this call's slot to its tag; trap if it never does.
__device__ void wait_for_peer(const DeviceState& mine, uint64_t slot, uint64_t tag, uint64_t call,
                              const char* collective) {
  const uint64_t began = now_ns();
  while (load_acquire(mine.flags + slot * kMaxBlocks + blockIdx.x) != tag) {
    if (now_ns() - began > kPeerTimeoutNs) {
      printf("shiftjax one-shot %s: the peer GPU did not arrive in 20 s (call %llu)\n", collective,
             static_cast<unsigned long long>(call));
      __trap();
    }
  }
}

// Once the block is done with this call's slot: the last block out advances the call number
// (every block has read it by then).
__device__ void finish_call(const DeviceState& mine) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(mine.counters + 1, 1ull) == gridDim.x - 1) {
      mine.counters[1] = 0;
      __threadfence();
      atomicAdd(mine.counters, 1ull);
    }
  }
}

__global__ void __launch_bounds__(kThreads) one_shot_kernel(
    const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out, int64_t n,
    DeviceState mine, DeviceState peer, size_t slot_bytes) {
  const uint64_t call = *reinterpret_cast<volatile unsigned long long*>(mine.counters);
  const uint64_t slot = call & 1u;
  const uint64_t tag = call + 1u;  // flags start at 0: never a live tag
  // block b owns the 16-byte words [begin, end)
  const int64_t words = n / 8;
  const int64_t per_block = (words + gridDim.x - 1) / gridDim.x;
  const int64_t begin = blockIdx.x * per_block;
  const int64_t end = begin + per_block < words ? begin + per_block : words;

  const uint4* x_words = reinterpret_cast<const uint4*>(x);
  uint4* peer_words = reinterpret_cast<uint4*>(peer.receive + slot * slot_bytes);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) peer_words[i] = x_words[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    store_release(peer.flags + slot * kMaxBlocks + blockIdx.x, tag);
    wait_for_peer(mine, slot, tag, call, "all-reduce");
  }
  __syncthreads();

  const uint4* received = reinterpret_cast<const uint4*>(mine.receive + slot * slot_bytes);
  uint4* out_words = reinterpret_cast<uint4*>(out);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    uint4 a = x_words[i], b = received[i], sum;
    const __nv_bfloat16* av = reinterpret_cast<const __nv_bfloat16*>(&a);
    const __nv_bfloat16* bv = reinterpret_cast<const __nv_bfloat16*>(&b);
    __nv_bfloat16* sv = reinterpret_cast<__nv_bfloat16*>(&sum);
#pragma unroll
    for (int k = 0; k < 8; ++k) sv[k] = __float2bfloat16_rn(__bfloat162float(av[k]) + __bfloat162float(bv[k]));
    out_words[i] = sum;
  }

  finish_call(mine);
}

// The all-to-all of two GPUs (tiled, concatenated on axis 0), by the same protocol: x is
// [outer][2][inner] words, out [2][outer][inner]. The caller's position r on the exchanged
// mesh axis (which need not be its rank in the group: a mesh may list the GPUs in either
// order) says which half stays: it keeps x[:, r] as out[r] and writes x[:, 1 - r] into the
// peer's receive slot, which becomes the peer's out[r]; then it waits for the peer's half
// and copies it to out[1 - r]. Slots, flags and the call number are the group rank's, as
// in the all-reduce, so that both kernels share one count per GPU.
__global__ void __launch_bounds__(kThreads) exchange_kernel(
    const uint4* __restrict__ x, uint4* __restrict__ out, uint32_t position,
    uint32_t outer, uint32_t inner, DeviceState mine, DeviceState peer, size_t slot_bytes) {
  const uint64_t call = *reinterpret_cast<volatile unsigned long long*>(mine.counters);
  const uint64_t slot = call & 1u;
  const uint64_t tag = call + 1u;
  const uint32_t words = outer * inner;  // per half
  const uint32_t per_block = (words + gridDim.x - 1) / gridDim.x;
  const uint32_t begin = blockIdx.x * per_block;
  const uint32_t end = begin + per_block < words ? begin + per_block : words;

  uint4* peer_words = reinterpret_cast<uint4*>(peer.receive + slot * slot_bytes);
  uint4* kept = out + position * words;
  // word i of half h of x: row i / inner of [outer][2][inner]
  auto x_word = [&](uint32_t i, uint32_t h) { return x[i + (i / inner) * inner + h * inner]; };
#if SHIFTJAX_EXCHANGE_BATCH > 1
  // loads of kBatch words in flight per thread before their stores over NVLink
  constexpr uint32_t kBatch = SHIFTJAX_EXCHANGE_BATCH;
  for (uint32_t first = begin + threadIdx.x; first < end; first += kBatch * blockDim.x) {
    uint4 words_in_flight[kBatch];
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      const uint32_t i = first + k * blockDim.x;
      if (i < end) words_in_flight[k] = x_word(i, 1 - position);
    }
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      const uint32_t i = first + k * blockDim.x;
      if (i < end) peer_words[i] = words_in_flight[k];
    }
  }
#else
#pragma unroll 4
  for (uint32_t i = begin + threadIdx.x; i < end; i += blockDim.x) peer_words[i] = x_word(i, 1 - position);
#endif
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    store_release(peer.flags + slot * kMaxBlocks + blockIdx.x, tag);
  }
  // my own half, while the peer's is on its way
#pragma unroll 4
  for (uint32_t i = begin + threadIdx.x; i < end; i += blockDim.x) kept[i] = x_word(i, position);
  if (threadIdx.x == 0) wait_for_peer(mine, slot, tag, call, "all-to-all");
  __syncthreads();

  const uint4* received = reinterpret_cast<const uint4*>(mine.receive + slot * slot_bytes);
  uint4* placed = out + (1 - position) * words;
#pragma unroll 4
  for (uint32_t i = begin + threadIdx.x; i < end; i += blockDim.x) placed[i] = received[i];
  finish_call(mine);
}

bool set_error(const std::string& message) {
  last_error = message;
  return false;
}

bool check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return true;
  return set_error(std::string(what) + ": " + cudaGetErrorString(status));
}

ffi::Error launched(const char* what) {
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + ": " + cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

// ~16 KiB of the message per block; every block of the grid must be resident at once (a block
// waits for the peer's block of the same index), so at most max_blocks
int grid_blocks(size_t bytes) {
  int64_t blocks = (static_cast<int64_t>(bytes) + 16383) / 16384;
  return static_cast<int>(blocks < 1 ? 1 : blocks > max_blocks ? max_blocks : blocks);
}

// This device's rank in the group set up, or -1.
int rank_of(int32_t device) { return device == group[0] ? 0 : device == group[1] ? 1 : -1; }

ffi::Error all_reduce(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x,
                      ffi::ResultBuffer<ffi::BF16> out) {
  int rank = rank_of(device);
  if (rank < 0) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "shiftjax one-shot all-reduce: device " + std::to_string(device) +
                          " is not in the group set up by shiftjax_all_reduce_setup");
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  const size_t bytes = static_cast<size_t>(n) * 2;
  if (n % 8 != 0 || bytes > capacity) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "shiftjax one-shot all-reduce: " + std::to_string(n) +
                          " elements: need a multiple of 8 and at most " + std::to_string(capacity / 2));
  }
  one_shot_kernel<<<grid_blocks(bytes), kThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.typed_data()),
      reinterpret_cast<__nv_bfloat16*>(out->typed_data()), n, states[rank], states[1 - rank], capacity);
  return launched("one-shot all-reduce launch");
}

// Checks an all-to-all's operands; sets *member (this device's rank in the group set up: whose
// buffers, flags and call number are its own, as for the all-reduce) and *position (0: this
// device is first on the exchanged mesh axis, whose half of x it keeps).
ffi::Error check_exchange(const char* name, int32_t device, int64_t first_ordinal, int64_t elements, int64_t outer,
                          int64_t inner, int64_t out_elements, int* member, int* position) {
  *member = rank_of(device);
  if (*member < 0 || rank_of(static_cast<int32_t>(first_ordinal)) < 0) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(name) + ": devices " + std::to_string(device) + " and " +
                          std::to_string(first_ordinal) + " are not the group set up by shiftjax_all_reduce_setup");
  }
  *position = device == first_ordinal ? 0 : 1;
  const size_t half_bytes = static_cast<size_t>(outer) * static_cast<size_t>(inner) * 2;
  // 32-bit word indices reach twice a half's words (x_word), plus a block's stride
  if (outer < 1 || inner < 8 || inner % 8 != 0 || elements != 2 * outer * inner || out_elements != elements ||
      half_bytes > capacity || 2 * outer * inner / 8 + kMaxBlocks * kThreads > INT32_MAX) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(name) + ": " + std::to_string(elements) + " elements as [" + std::to_string(outer) +
                          "][2][" + std::to_string(inner) + "]: need inner a multiple of 8, an output of as many "
                          "elements and a half of at most " + std::to_string(capacity) + " bytes");
  }
  return ffi::Error::Success();
}

ffi::Error all_to_all(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x, ffi::ResultBuffer<ffi::BF16> out,
                      int64_t outer, int64_t inner, int64_t first_ordinal) {
  int member = 0, position = 0;
  ffi::Error checked = check_exchange("shiftjax one-shot all-to-all", device, first_ordinal,
                                      static_cast<int64_t>(x.element_count()), outer, inner,
                                      static_cast<int64_t>(out->element_count()), &member, &position);
  if (checked.failure()) return checked;
  exchange_kernel<<<grid_blocks(outer * inner * 2), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(x.typed_data()), reinterpret_cast<uint4*>(out->typed_data()),
      static_cast<uint32_t>(position), static_cast<uint32_t>(outer), static_cast<uint32_t>(inner / 8),
      states[member], states[1 - member], capacity);
  return launched("one-shot all-to-all launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShiftjaxOneShotAllReduce, all_reduce,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShiftjaxOneShotAllToAll, all_to_all,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("outer")
                                  .Attr<int64_t>("inner")
                                  .Attr<int64_t>("first_ordinal"),
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {

// Allocates both devices' receive buffers, flags and counters (zeroed) and enables peer
// access both ways. Call once, before any step that uses the all-reduce runs; a second call
// with the same group and a capacity no larger is a no-op. require_nvlink: refuse a pair whose
// peer access lacks native atomics (PCIe), where the kernel was never measured. Returns 1 on
// success, else 0 (nothing left allocated) and shiftjax_all_reduce_error() says why.
int shiftjax_all_reduce_setup(int ordinal0, int ordinal1, unsigned long long slot_bytes, int require_nvlink) {
  std::lock_guard<std::mutex> lock(mutex);
  if (ordinal0 < 0 || ordinal1 < 0 || ordinal0 >= kMaxDevices || ordinal1 >= kMaxDevices ||
      ordinal0 == ordinal1) {
    return set_error("two distinct CUDA ordinals are needed");
  }
  if (capacity != 0) {
    if (group[0] == ordinal0 && group[1] == ordinal1 && slot_bytes <= capacity) return 1;
    return set_error("already set up for GPUs " + std::to_string(group[0]) + " and " + std::to_string(group[1]) +
                     " with " + std::to_string(capacity) + " bytes per slot");
  }
  const int ordinals[2] = {ordinal0, ordinal1};
  for (int rank = 0; rank < 2; ++rank) {  // peer access first: nothing to undo if it is missing
    int can_access = 0, native_atomics = 0;
    if (!check(cudaDeviceCanAccessPeer(&can_access, ordinals[rank], ordinals[1 - rank]), "cudaDeviceCanAccessPeer") ||
        !check(cudaDeviceGetP2PAttribute(&native_atomics, cudaDevP2PAttrNativeAtomicSupported, ordinals[rank],
                                         ordinals[1 - rank]), "cudaDeviceGetP2PAttribute")) {
      return 0;
    }
    if (!can_access) return set_error("the two GPUs cannot access each other's memory (no P2P)");
    if (require_nvlink && !native_atomics) {
      return set_error("the two GPUs' peer access has no native atomics (not NVLink)");
    }
  }
  int previous = 0;
  if (!check(cudaGetDevice(&previous), "cudaGetDevice")) return 0;
  slot_bytes = (slot_bytes + 15) / 16 * 16;
  DeviceState made[2];
  int resident = kMaxBlocks;
  bool ok = true;
  for (int rank = 0; rank < 2 && ok; ++rank) {
    DeviceState& state = made[rank];
    int per_sm = 0, per_sm_exchange = 0, sms = 0;
    ok = check(cudaSetDevice(ordinals[rank]), "cudaSetDevice") &&
         check(cudaMalloc(&state.receive, 2 * slot_bytes), "cudaMalloc (receive)") &&
         check(cudaMalloc(&state.flags, 2 * kMaxBlocks * sizeof(uint64_t)), "cudaMalloc (flags)") &&
         check(cudaMalloc(&state.counters, 2 * sizeof(unsigned long long)), "cudaMalloc (counters)") &&
         check(cudaMemset(state.flags, 0, 2 * kMaxBlocks * sizeof(uint64_t)), "cudaMemset") &&
         check(cudaMemset(state.counters, 0, 2 * sizeof(unsigned long long)), "cudaMemset") &&
         check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, one_shot_kernel, kThreads, 0),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor") &&
         check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_exchange, exchange_kernel, kThreads, 0),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor") &&
         check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinals[rank]), "cudaDeviceGetAttribute");
    if (ok) {
      per_sm = per_sm_exchange < per_sm ? per_sm_exchange : per_sm;
      resident = per_sm * sms < resident ? per_sm * sms : resident;
      cudaError_t status = cudaDeviceEnablePeerAccess(ordinals[1 - rank], 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear it: already enabled (by XLA or NCCL) is what we want
      } else {
        ok = check(status, "cudaDeviceEnablePeerAccess");
      }
      ok = ok && check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }
  }
  if (ok && resident < 1) ok = set_error("the kernel cannot be resident on these GPUs");
  if (!ok) {  // free what was made on either GPU
    for (int rank = 0; rank < 2; ++rank) {
      cudaSetDevice(ordinals[rank]);
      cudaFree(made[rank].receive);
      cudaFree(made[rank].flags);
      cudaFree(made[rank].counters);
    }
  }
  cudaSetDevice(previous);
  if (!ok) return 0;
  states[0] = made[0];
  states[1] = made[1];
  max_blocks = resident;
  group[0] = ordinal0;
  group[1] = ordinal1;
  capacity = slot_bytes;
  return 1;
}

const char* shiftjax_all_reduce_error() { return last_error.c_str(); }

}  // extern "C"
