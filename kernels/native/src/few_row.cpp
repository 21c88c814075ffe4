// kvtier: the few-row product as an MLX primitive, so it stays inside MLX's
// lazy graph on the CPU stream (an eager call would evaluate the graph at every
// projection). Built on demand by kernels/native/_build.py against the
// installed MLX headers and nanobind (domain "mlx", so arrays cross as
// mlx.core.array).
#include <stdexcept>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

extern "C" int kvtier_few_row_matmul(
    const float* x, const float* w, float* y, int M, int K, int N, int threads);
extern "C" void kvtier_softmax_rows(const float* x, float* y, long rows, int n, int threads);
extern "C" void kvtier_softmax_causal_rows(
    const float* x, float* y, long rows, int n, int period, int offset, int threads);
extern "C" void kvtier_softmax_masked_rows(const float* x, const unsigned char* mask, float* y,
                                           long rows, int n, long per_batch, long mask_batches,
                                           long period, int threads);

namespace {

class FewRowMatmul : public mx::Primitive {
 public:
  FewRowMatmul(mx::Stream stream, int threads) : mx::Primitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    auto& out = outputs[0];
    if (!x.flags().row_contiguous || !w.flags().row_contiguous) {
      throw std::runtime_error("few_row: inputs must be row-contiguous");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    const int k = static_cast<int>(w.shape(1));
    const int n = static_cast<int>(w.shape(0));
    const int m = k == 0 ? 0 : static_cast<int>(x.size() / k);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x),
                      w = mx::array::unsafe_weak_copy(w),
                      out = mx::array::unsafe_weak_copy(out),
                      m, k, n, threads = threads_]() mutable {
      kvtier_few_row_matmul(x.data<float>(), w.data<float>(), out.data<float>(), m, k, n, threads);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("few_row runs on the CPU only");
  }

  const char* name() const override {
    return "KvtierFewRowMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return threads_ == static_cast<const FewRowMatmul&>(other).threads_;
  }

 private:
  int threads_;
};

mx::array few_row(const mx::array& x, const mx::array& w, int threads) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    throw std::invalid_argument("few_row: x and w must be float32");
  }
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("few_row: x (..., K) and w (N, K)");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  auto xc = mx::contiguous(x, false, stream);
  // NOTE: weights are evaluated and row-contiguous; no copy node for them (a
  // decode step makes ~120 products).
  auto wc = w.is_available() && w.flags().row_contiguous ? w : mx::contiguous(w, false, stream);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      std::move(shape), mx::float32, std::make_shared<FewRowMatmul>(stream, threads), {xc, wc});
}

// Softmax over the last axis of a float32 array (src/softmax.c): an 8-lane exp
// where MLX's CPU backend on x86 calls expf per element.
class SoftmaxRows : public mx::Primitive {
 public:
  // period 0: plain rows; otherwise row r sees offset + r % period + 1 elements.
  SoftmaxRows(mx::Stream stream, int period, int offset, int threads)
      : mx::Primitive(stream), period_(period), offset_(offset), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    auto& out = outputs[0];
    if (!x.flags().row_contiguous) {
      throw std::runtime_error("softmax: the input must be row-contiguous");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    const int n = x.ndim() == 0 ? 1 : static_cast<int>(x.shape(-1));
    const long rows = n == 0 ? 0 : static_cast<long>(x.size() / n);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x),
                      out = mx::array::unsafe_weak_copy(out), rows, n,
                      period = period_, offset = offset_, threads = threads_]() mutable {
      if (period > 0) {
        kvtier_softmax_causal_rows(
            x.data<float>(), out.data<float>(), rows, n, period, offset, threads);
      } else {
        kvtier_softmax_rows(x.data<float>(), out.data<float>(), rows, n, threads);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("softmax runs on the CPU only");
  }

  const char* name() const override {
    return "KvtierSoftmaxRows";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const SoftmaxRows&>(other);
    return period_ == o.period_ && offset_ == o.offset_ && threads_ == o.threads_;
  }

 private:
  int period_;
  int offset_;
  int threads_;
};

// Softmax over the last axis where a boolean mask row hides elements (src/softmax.c's
// masked rows): x row g reads mask row ((g / per_batch) % mask_batches) * period +
// (g % per_batch) % period.
class SoftmaxMaskedRows : public mx::Primitive {
 public:
  SoftmaxMaskedRows(mx::Stream stream, long per_batch, long mask_batches, long period, int threads)
      : mx::Primitive(stream),
        per_batch_(per_batch),
        mask_batches_(mask_batches),
        period_(period),
        threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& mask = inputs[1];
    auto& out = outputs[0];
    if (!x.flags().row_contiguous || !mask.flags().row_contiguous) {
      throw std::runtime_error("softmax_masked: the inputs must be row-contiguous");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(mask);
    encoder.set_output_array(out);
    const int n = static_cast<int>(x.shape(-1));
    const long rows = n == 0 ? 0 : static_cast<long>(x.size() / n);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), mask = mx::array::unsafe_weak_copy(mask),
                      out = mx::array::unsafe_weak_copy(out), rows, n, per_batch = per_batch_,
                      mask_batches = mask_batches_, period = period_,
                      threads = threads_]() mutable {
      kvtier_softmax_masked_rows(x.data<float>(), mask.data<unsigned char>(), out.data<float>(),
                                 rows, n, per_batch, mask_batches, period, threads);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("softmax_masked runs on the CPU only");
  }

  const char* name() const override {
    return "KvtierSoftmaxMaskedRows";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const SoftmaxMaskedRows&>(other);
    return per_batch_ == o.per_batch_ && mask_batches_ == o.mask_batches_ &&
        period_ == o.period_ && threads_ == o.threads_;
  }

 private:
  long per_batch_;
  long mask_batches_;
  long period_;
  int threads_;
};

mx::array softmax_masked(const mx::array& x, const mx::array& mask, long per_batch,
                         long mask_batches, long period, int threads) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument("softmax_masked: x must be float32");
  }
  if (mask.dtype() != mx::bool_) {
    throw std::invalid_argument("softmax_masked: mask must be bool");
  }
  if (x.ndim() < 1 || x.shape(-1) < 1 || x.shape(-1) > (1 << 30)) {
    throw std::invalid_argument("softmax_masked: x must have a last axis of 1 to 2^30");
  }
  if (mask.ndim() < 1 || mask.shape(-1) != x.shape(-1)) {
    throw std::invalid_argument("softmax_masked: mask rows must be as long as x's");
  }
  if (per_batch < 1 || mask_batches < 1 || period < 1 || threads < 1 || threads > 16) {
    throw std::invalid_argument(
        "softmax_masked: per_batch, mask_batches and period must be >= 1, threads 1-16");
  }
  const long rows = static_cast<long>(x.size() / x.shape(-1));
  const long mask_rows = static_cast<long>(mask.size() / mask.shape(-1));
  if (mask_rows != mask_batches * period || rows % per_batch != 0) {
    throw std::invalid_argument(
        "softmax_masked: the mask needs mask_batches x period rows and x whole batches");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  auto xc = mx::contiguous(x, false, stream);
  auto mc = mx::contiguous(mask, false, stream);
  return mx::array(
      x.shape(), mx::float32,
      std::make_shared<SoftmaxMaskedRows>(stream, per_batch, mask_batches, period, threads),
      {xc, mc});
}

mx::array softmax_impl(const mx::array& x, int period, int offset, int threads) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument("softmax: x must be float32");
  }
  if (x.ndim() < 1 || x.shape(-1) > (1 << 30)) {
    throw std::invalid_argument("softmax: x must have a last axis of at most 2^30");
  }
  if (period < 0 || offset < 0) {
    throw std::invalid_argument("softmax: period and offset must be >= 0");
  }
  if (threads < 1 || threads > 16) {
    throw std::invalid_argument("softmax: threads must be 1-16");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  auto xc = mx::contiguous(x, false, stream);
  return mx::array(
      x.shape(), mx::float32, std::make_shared<SoftmaxRows>(stream, period, offset, threads),
      {xc});
}

mx::array softmax(const mx::array& x, int threads) {
  return softmax_impl(x, 0, 0, threads);
}

mx::array softmax_causal(const mx::array& x, int period, int offset, int threads) {
  if (period < 1) {
    throw std::invalid_argument("softmax_causal: period must be >= 1");
  }
  return softmax_impl(x, period, offset, threads);
}

}  // namespace

NB_MODULE(_kvtier_few_row, m) {
  m.def("few_row", &few_row, nb::arg("x"), nb::arg("w"), nb::arg("threads") = 2,
        "x @ w.T on the CPU stream for float32 x (..., K) and w (N, K), each output row "
        "independent of the others.");
  m.def("softmax", &softmax, nb::arg("x"), nb::arg("threads") = 1,
        "Softmax over the last axis of a float32 x on the CPU stream; a row's result does not "
        "depend on leading elements whose exp is zero, nor on the threads its rows are split "
        "across.");
  m.def("softmax_masked", &softmax_masked, nb::arg("x"), nb::arg("mask"), nb::arg("per_batch"),
        nb::arg("mask_batches"), nb::arg("period"), nb::arg("threads") = 1,
        "Softmax over the last axis of a float32 x where a bool mask row hides elements: x row "
        "g reads mask row ((g / per_batch) % mask_batches) * period + (g % per_batch) % period; "
        "the same bits as where(mask, x, lowest) then softmax.");
  m.def("softmax_causal", &softmax_causal, nb::arg("x"), nb::arg("period"), nb::arg("offset"),
        nb::arg("threads") = 1,
        "Softmax over the last axis where row r sees only its first offset + r % period + 1 "
        "elements (bottom-right causal attention with the queries folded); the rest are 0.");
}
