// Adam/AdamW for XLA:CPU, called through the XLA FFI, in one pass over memory.
//
// Two handlers:
// - OfflaxAdamMomentsF32 (what offlax.adam uses): reads g, m, v once, writes m
//   and v in place. The moments are optax's, bit for bit: on a CPU with FMA,
//   LLVM contracts XLA:CPU's `(1 - b1) * g + b1 * m` into fma((1 - b1), g, b1 * m)
//   (the multiplication on the left of the addition), so this spells out the
//   same FMAs and forbids the compiler any other (-ffp-contract=off); built
//   with -mno-fma when XLA is told not to use FMA.
// - OfflaxAdamF32: the whole step, also writing the update (into the
//   gradient's buffer when XLA aliases them). XLA:CPU's rounding of the update
//   depends on the program around it (it may multiply by the bias corrections'
//   reciprocals, or fold them into one division); this computes
//   m / (bc1 * (sqrt(v * (1 / bc2) + eps_root) + eps)), close to the form it
//   uses for trees of several leaves but with one division per element, not
//   two, and agrees with optax to rounding (tests/test_host_adam.py states the
//   tolerance).
// - OfflaxAdamStep: the whole step of a param (or of its fp32 master copy, for
//   offlax.master_weights): moments, update and the new param in one pass, in
//   place; the gradient float32 or bfloat16; with a master, also the new
//   low-precision param (or its exact update, the rounded new master minus the
//   param). The update is optax's expression as written,
//   (m / bc1) / (sqrt(v / bc2 + eps_root) + eps), so with XLA told to evaluate
//   as written (no algebraic rewrites, no FMA) it is bit-identical to XLA's;
//   under XLA's defaults it agrees to rounding.
// Division and square root are IEEE, and vectorise exactly.
//
// Threads: each call splits its arrays in 256 KiB chunks over the calling
// thread and XLA's intra-op pool (one thread per core), capped by
// OFFLAX_NATIVE_THREADS when set. Where XLA gives a call fewer than two threads
// (a GPU program's host computation: measured on an H200's 16-core host, the
// host step ran at one core's speed), offlax's own pool of one thread per core
// takes its place; OFFLAX_NATIVE_POOL=xla or =own forces either, and
// OFFLAX_NATIVE_DEBUG=1 says on stderr, once, what a call was given.
#include "common.h"

namespace {

using namespace offlax_native;  // NOLINT: the kernels share its names

struct Job;
// Updates elements [lo, hi) of a job's arrays.
using Kernel = void (*)(const Job&, int64_t, int64_t);

struct Job : Chunks {
  Kernel kernel;
  const void* g;  // float, or bfloat16 for OfflaxAdamStep
  const float* m;
  const float* v;
  const float* p;  // OfflaxAdamF32 with decay: the param
  float* u;        // OfflaxAdamF32: the update
  float* m_out;
  float* v_out;
  // OfflaxAdamStep: the param (or master) updated in place, and with a master
  // the low-precision param read (`low`) and its new value or update written (`out`).
  const float* w;
  float* w_out;
  const void* low;
  void* out;
  float h[kNumHyper];
  int64_t size;
  int64_t chunk;
  void RunChunk(int64_t c) const { kernel(*this, c * chunk, std::min(size, (c + 1) * chunk)); }
};

// Elements per cache line, per block of the loop, and prefetched ahead.
constexpr int64_t kLine = 16, kBlock = 4 * kLine, kAhead = 512;

// What a call of OfflaxAdamMomentsF32 or OfflaxAdamF32 computes.
enum class Mode { kMoments, kAdam, kAdamW };

template <Mode kMode>
void Update(const Job& j, int64_t lo, int64_t hi) {
  // Locals, so the compiler knows stores to the arrays leave them unchanged,
  // and vectorises the loop.
  const float c1 = j.h[kC1], b1 = j.h[kB1], c2 = j.h[kC2], b2 = j.h[kB2];
  const float bc1 = j.h[kBc1], bc2 = j.h[kBc2], eps_root = j.h[kEpsRoot];
  const float eps = j.h[kEps], step = j.h[kStep], wd = j.h[kWd];
  // One division per element, not two (see the top of this file).
  const float inv_bc2 = 1.0f / bc2;
  const float* g_in = static_cast<const float*>(j.g) + lo;
  const float* m_in = j.m + lo;
  const float* v_in = j.v + lo;
  const float* p_in = kMode == Mode::kAdamW ? j.p + lo : nullptr;
  float* u_out = kMode == Mode::kMoments ? nullptr : j.u + lo;
  float* m_out = j.m_out + lo;
  float* v_out = j.v_out + lo;
  const int64_t n = hi - lo;
  // Blocks of four cache lines, each first prefetching the inputs 2 KiB ahead:
  // the hardware prefetchers alone keep too few lines of these three or four
  // streams in flight per core. Measured on 2 cores (Xeon, 480 MB L3), 8 leaves,
  // the kernel alone: 1.4x at 16M params (state in L3), 1.18x at 64M, 1.12x at 256M.
  for (int64_t first = 0; first < n; first += kBlock) {
    for (int64_t k = first + kAhead; k < std::min(n, first + kAhead + kBlock); k += kLine) {
      __builtin_prefetch(g_in + k);
      __builtin_prefetch(m_in + k);
      __builtin_prefetch(v_in + k);
      if constexpr (kMode == Mode::kAdamW) __builtin_prefetch(p_in + k);
    }
    const int64_t end = std::min(n, first + kBlock);
    // No iteration reads what another writes (outputs may alias inputs, element
    // for element), so the loop vectorises without alias checks.
#pragma GCC ivdep
    for (int64_t i = first; i < end; ++i) {
      const float g = g_in[i];
      const float m = MulAdd(c1, g, b1 * m_in[i]);      // (1 - b1) * g + b1 * m
      const float v = MulAdd(c2, g * g, b2 * v_in[i]);  // (1 - b2) * g**2 + b2 * v
      m_out[i] = m;
      v_out[i] = v;
      if constexpr (kMode != Mode::kMoments) {
        float u = m / (bc1 * (std::sqrt(v * inv_bc2 + eps_root) + eps));
        if constexpr (kMode == Mode::kAdamW) u = MulAdd(wd, p_in[i], u);  // u + wd * p
        u_out[i] = step * u;  // scale_by_learning_rate
      }
    }
  }
}

// The whole Adam(W) step of one param or master `w`, with gradient type G and
// low-precision param type P (uint16_t: bfloat16). As optax computes it:
// u = (m / bc1) / (sqrt(v / bc2 + eps_root) + eps); u += wd * w;
// w += lr_step * u (optax.apply_updates). With a master the low-precision
// param becomes w rounded to P, written as itself or as the float32
// difference (exact: both terms are exact in float32).
template <typename G, typename P, Out kOut, bool kDecay>
void FullStep(const Job& j, int64_t lo, int64_t hi) {
  const float c1 = j.h[kC1], b1 = j.h[kB1], c2 = j.h[kC2], b2 = j.h[kB2];
  const float bc1 = j.h[kBc1], bc2 = j.h[kBc2], eps_root = j.h[kEpsRoot];
  const float eps = j.h[kEps], step = j.h[kStep], wd = j.h[kWd];
  const G* g_in = static_cast<const G*>(j.g) + lo;
  const float* m_in = j.m + lo;
  const float* v_in = j.v + lo;
  const float* w_in = j.w + lo;
  const P* low_in = kOut == Out::kDelta ? static_cast<const P*>(j.low) + lo : nullptr;
  float* m_out = j.m_out + lo;
  float* v_out = j.v_out + lo;
  float* w_out = j.w_out + lo;
  float* delta_out = kOut == Out::kDelta ? static_cast<float*>(j.out) + lo : nullptr;
  P* low_out = kOut == Out::kParam ? static_cast<P*>(j.out) + lo : nullptr;
  const int64_t n = hi - lo;
  for (int64_t first = 0; first < n; first += kBlock) {
    for (int64_t k = first + kAhead; k < std::min(n, first + kAhead + kBlock); k += kLine) {
      __builtin_prefetch(m_in + k);
      __builtin_prefetch(v_in + k);
      __builtin_prefetch(w_in + k);
      if (k % (kLine * sizeof(float) / sizeof(G)) == 0) __builtin_prefetch(g_in + k);
      if constexpr (kOut == Out::kDelta) {
        if (k % (kLine * sizeof(float) / sizeof(P)) == 0) __builtin_prefetch(low_in + k);
      }
    }
    const int64_t end = std::min(n, first + kBlock);
#pragma GCC ivdep
    for (int64_t i = first; i < end; ++i) {
      const float g = Widen(g_in[i]);
      const float m = MulAdd(c1, g, b1 * m_in[i]);
      const float v = MulAdd(c2, g * g, b2 * v_in[i]);
      float u = (m / bc1) / (std::sqrt(v / bc2 + eps_root) + eps);
      if constexpr (kDecay) u = MulAdd(wd, w_in[i], u);  // add_decayed_weights
      const float w = MulAdd(step, u, w_in[i]);           // apply_updates(w, step * u)
      m_out[i] = m;
      v_out[i] = v;
      w_out[i] = w;
      if constexpr (kOut == Out::kDelta) {
        delta_out[i] = Widen(Narrow<P>(w)) - Widen(low_in[i]);
      } else if constexpr (kOut == Out::kParam) {
        low_out[i] = Narrow<P>(w);
      }
    }
  }
}

// Splits the arrays in chunks over the caller and XLA's intra-op threads (or offlax's own).
ffi::Error Run(ffi::ThreadPool& pool, std::shared_ptr<Job> job, ffi::Buffer<ffi::F32>& hyper,
               size_t needed) {
  if (hyper.element_count() != needed) {
    return ffi::Error::InvalidArgument("offlax adam: wrong number of hyperparameters");
  }
  std::copy_n(hyper.typed_data(), needed, job->h);
  job->chunk = int64_t{1} << 16;  // 256 KiB of each array: big enough to amortise
  job->num_chunks = (job->size + job->chunk - 1) / job->chunk;
  RunChunks(pool, job, job->size);
  return ffi::Error::Success();
}

std::shared_ptr<Job> MakeJob(ffi::Buffer<ffi::F32>& g, ffi::Buffer<ffi::F32>& m,
                             ffi::Buffer<ffi::F32>& v, ffi::ResultBuffer<ffi::F32>& m_out,
                             ffi::ResultBuffer<ffi::F32>& v_out) {
  auto job = std::make_shared<Job>();
  job->g = g.typed_data();
  job->m = m.typed_data();
  job->v = v.typed_data();
  job->m_out = m_out->typed_data();
  job->v_out = v_out->typed_data();
  job->size = static_cast<int64_t>(g.element_count());
  return job;
}

// The moments, in place; XLA computes the update from them (fused with what
// consumes it, e.g. optax.apply_updates).
ffi::Error MomentsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> m,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> hyper,
                       ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> v_out) {
  if (m.element_count() != g.element_count() || v.element_count() != g.element_count()) {
    return ffi::Error::InvalidArgument("offlax adam: g, m and v differ in size");
  }
  auto job = MakeJob(g, m, v, m_out, v_out);
  job->kernel = Update<Mode::kMoments>;
  return Run(pool, job, hyper, kBc1);  // the first four hyperparameters only
}

// The moments and the update (into the gradient's buffer when XLA aliases it).
ffi::Error AdamImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> m,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> p,
                    ffi::Buffer<ffi::F32> hyper, ffi::ResultBuffer<ffi::F32> u,
                    ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> v_out,
                    bool decay) {
  if (m.element_count() != g.element_count() || v.element_count() != g.element_count() ||
      (decay && p.element_count() != g.element_count())) {
    return ffi::Error::InvalidArgument("offlax adam: g, m, v and p differ in size");
  }
  auto job = MakeJob(g, m, v, m_out, v_out);
  job->kernel = decay ? Update<Mode::kAdamW> : Update<Mode::kAdam>;
  job->p = p.typed_data();
  job->u = u->typed_data();
  return Run(pool, job, hyper, kNumHyper);
}

template <typename G, typename P, Out kOut>
Kernel PickDecay(bool decay) {
  return decay ? FullStep<G, P, kOut, true> : FullStep<G, P, kOut, false>;
}

template <typename G>
Kernel PickOut(int32_t out, bool low_bf16, bool decay) {
  switch (static_cast<Out>(out)) {
    case Out::kNone: return PickDecay<G, float, Out::kNone>(decay);
    case Out::kDelta:
      return low_bf16 ? PickDecay<G, uint16_t, Out::kDelta>(decay)
                      : PickDecay<G, float, Out::kDelta>(decay);
    case Out::kParam:
      return low_bf16 ? PickDecay<G, uint16_t, Out::kParam>(decay)
                      : PickDecay<G, float, Out::kParam>(decay);
    case Out::kUpdate: return nullptr;  // adam8.cc's only
  }
  return nullptr;
}

// The whole step: w (the param, or the master) and the moments in place; with
// `out` != kNone also the low-precision param `low` updated, written as the new
// param or its float32 update into `result`. `result` is a placeholder of one
// element when out == kNone.
ffi::Error StepImpl(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> m,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer low,
                    ffi::Buffer<ffi::F32> hyper, ffi::Result<ffi::AnyBuffer> result,
                    ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> v_out,
                    ffi::ResultBuffer<ffi::F32> w_out, bool decay, int32_t out) {
  const size_t n = g.element_count();
  if (m.element_count() != n || v.element_count() != n || w.element_count() != n ||
      (out != 0 && (low.element_count() != n || result->element_count() != n))) {
    return ffi::Error::InvalidArgument("offlax adam step: g, m, v, w and the param differ in size");
  }
  if (!F32OrBf16(g.element_type()) || (out != 0 && !F32OrBf16(low.element_type())) ||
      out < 0 || out > 2) {
    return ffi::Error::InvalidArgument("offlax adam step: unsupported dtype or output");
  }
  const bool low_bf16 = low.element_type() == ffi::DataType::BF16;
  auto job = std::make_shared<Job>();
  job->kernel = g.element_type() == ffi::DataType::BF16
                    ? PickOut<uint16_t>(out, low_bf16, decay)
                    : PickOut<float>(out, low_bf16, decay);
  job->g = g.untyped_data();
  job->m = m.typed_data();
  job->v = v.typed_data();
  job->w = w.typed_data();
  job->low = low.untyped_data();
  job->out = result->untyped_data();
  job->m_out = m_out->typed_data();
  job->v_out = v_out->typed_data();
  job->w_out = w_out->typed_data();
  job->size = static_cast<int64_t>(n);
  return Run(pool, job, hyper, kNumHyper);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OfflaxAdamMomentsF32, MomentsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // hyperparameters
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m
                                  .Ret<ffi::Buffer<ffi::F32>>());  // v

XLA_FFI_DEFINE_HANDLER_SYMBOL(OfflaxAdamF32, AdamImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // p (read iff decay)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // hyperparameters
                                  .Ret<ffi::Buffer<ffi::F32>>()  // update
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v
                                  .Attr<bool>("decay"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OfflaxAdamStep, StepImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // g (f32 or bf16)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w: the param or master
                                  .Arg<ffi::AnyBuffer>()         // the low-precision param
                                  .Arg<ffi::Buffer<ffi::F32>>()  // hyperparameters
                                  .Ret<ffi::AnyBuffer>()         // new param or its update
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v
                                  .Ret<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<bool>("decay")
                                  .Attr<int32_t>("out"));
