// slime/rl/kl.hpp: per-token KL estimators between the policy (lp) and a
// reference (ref), with their derivative with respect to lp, on raw pointers
// (float or double) and CPU Tensors.
//
//   k1 = lp − ref                                   d/dlp = 1
//   k2 = (lp − ref)² / 2                            d/dlp = lp − ref
//   k3 = exp(ref − lp) − (ref − lp) − 1              d/dlp = 1 − exp(ref − lp)
//   low_var_kl = k3 clamped to [−10, 10]            d/dlp as k3, 0 where clamped
// Unbiased option: kl · exp(lp − old), the importance ratio from the sampling
// policy (old) to the current one, with the gradient through both factors;
// low_var_kl clamps the product.
// All inputs are natural-log probabilities of the sampled tokens.
//
// These are THUDM/slime's --kl-loss-type estimators (slime/utils/ppo_utils.py,
// compute_approx_kl), its default k1 included: k3 is unclamped there, and
// only low_var_kl clamps, after the importance ratio.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "slime/rl/metrics.hpp"

namespace slime::rl {

enum class KlEstimator { k1, k2, k3, low_var_kl };

// low_var_kl's bound on |KL| per token.
inline constexpr double low_var_kl_clamp = 10.0;

// The estimator's value at one token and its derivative with respect to lp.
template <class T>
struct KlTerm {
  T value;
  T grad;  // d value / d lp
};

namespace detail {

// The estimator before low_var_kl's clamp (low_var_kl: k3).
template <class T>
inline KlTerm<T> kl_unclamped(KlEstimator estimator, T lp, T ref) {
  switch (estimator) {
    case KlEstimator::k1:
      return {lp - ref, T(1)};
    case KlEstimator::k2:
      return {(lp - ref) * (lp - ref) / T(2), lp - ref};
    case KlEstimator::k3:
    case KlEstimator::low_var_kl: {
      const T d = ref - lp;
      const T e = std::exp(d);
      return {e - d - T(1), T(1) - e};
    }
  }
  SLIME_FAIL("kl_term: unknown estimator");
}

// low_var_kl: the value clamped to [−10, 10], no gradient where clamped.
template <class T>
inline KlTerm<T> clamp_low_var(KlEstimator estimator, KlTerm<T> k) {
  if (estimator != KlEstimator::low_var_kl) return k;
  if (k.value > T(low_var_kl_clamp)) return {T(low_var_kl_clamp), T(0)};
  if (k.value < T(-low_var_kl_clamp)) return {T(-low_var_kl_clamp), T(0)};
  return k;
}

}  // namespace detail

template <class T>
inline KlTerm<T> kl_term(KlEstimator estimator, T lp, T ref) {
  return detail::clamp_low_var(estimator, detail::kl_unclamped(estimator, lp, ref));
}

// With the unbiased correction: value · r, r = exp(lp − old); d/dlp = r · (grad + value);
// low_var_kl clamps the product (as slime does).
template <class T>
inline KlTerm<T> kl_term_unbiased(KlEstimator estimator, T lp, T ref, T old) {
  const KlTerm<T> k = detail::kl_unclamped(estimator, lp, ref);
  const T r = std::exp(lp - old);
  return detail::clamp_low_var(estimator, KlTerm<T>{k.value * r, r * (k.grad + k.value)});
}

namespace cpu {

// kl[t] (and maybe_grad[t] = d kl[t] / d lp[t]) for t in [0, tokens); maybe_old
// non-null selects the unbiased correction. Written (=), no mask applied.
template <class T>
void kl_per_token(KlEstimator estimator, const T* lp, const T* ref, const std::type_identity_t<T>* maybe_old,
                  int64_t tokens, T* kl, std::type_identity_t<T>* maybe_grad) {
  SLIME_CHECK(tokens >= 0, "kl_per_token: tokens must be >= 0, got ", tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    const KlTerm<T> k =
        maybe_old ? kl_term_unbiased(estimator, lp[t], ref[t], maybe_old[t]) : kl_term(estimator, lp[t], ref[t]);
    kl[t] = k.value;
    if (maybe_grad) maybe_grad[t] = k.grad;
  }
}

}  // namespace cpu

// f32 CPU tensors [tokens]; `old` undefined for the plain estimator.
inline Tensor kl_per_token(KlEstimator estimator, const Tensor& lp, const Tensor& ref, const Tensor& old = {}) {
  constexpr std::string_view fn = "rl::kl_per_token";
  detail::require_cpu(fn, lp);
  SLIME_CHECK(lp.dim() == 1, fn, ": lp must be 1-d [tokens], got ", lp.str());
  const int64_t n = lp.size(0);
  detail::check_token_tensor(fn, lp, DType::f32, n, "lp");
  detail::check_token_tensor(fn, ref, DType::f32, n, "ref");
  if (old.defined()) detail::check_token_tensor(fn, old, DType::f32, n, "old");
  Tensor out = Tensor::empty(Shape{n}, DType::f32);
  cpu::kl_per_token<float>(estimator, lp.data<float>(), ref.data<float>(), detail::maybe_data<float>(old), n,
                           out.data<float>(), nullptr);
  return out;
}

}  // namespace slime::rl
