// Tensor: construction, views, reshape, copies, errors, and allocator
// statistics on the CPU.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <numeric>

#include "slime/core/tensor.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

TEST_CASE("dtype sizes, names and parsing", "[core][tensor]") {
  CHECK(dtype_size(DType::f32) == 4);
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::f16) == 2);
  CHECK(dtype_size(DType::i32) == 4);
  CHECK(dtype_size(DType::i64) == 8);
  CHECK(dtype_size(DType::u8) == 1);
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8})
    CHECK(parse_dtype(dtype_name(t)) == t);
  CHECK(parse_dtype("bfloat16") == DType::bf16);
  CHECK(parse_dtype("F32") == DType::f32);
  CHECK_THROWS_WITH(parse_dtype("float8"), ContainsSubstring("unknown dtype 'float8'"));
  CHECK(Elems(10).bytes(DType::bf16) == 20);
}

TEST_CASE("shape basics and errors", "[core][tensor]") {
  Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s[-1] == 4);
  CHECK(s.str() == "(2, 3, 4)");
  CHECK(Shape{5}.str() == "(5,)");
  CHECK(Shape{}.numel() == 1);
  CHECK_THROWS_WITH(s[3], ContainsSubstring("out of range"));
  CHECK_THROWS_WITH((Shape{2, -1}), ContainsSubstring("negative extent"));
  CHECK_THROWS_AS((Shape{1, 1, 1, 1, 1, 1, 1, 1, 1}), Error);
}

TEST_CASE("from_vector, to_vector and typed access", "[core][tensor]") {
  std::vector<float> v(12);
  std::iota(v.begin(), v.end(), 1.f);
  Tensor t = Tensor::from_vector(v, {3, 4});
  CHECK(t.dtype() == DType::f32);
  CHECK(t.device() == Device::cpu());
  CHECK(t.numel() == 12);
  CHECK(t.nbytes() == 48);
  CHECK(t.to_vector<float>() == v);
  CHECK(t.data<float>()[5] == 6.f);
  CHECK_THROWS_WITH(t.data<int32_t>(), ContainsSubstring("data<i32>() on a f32 tensor"));
  CHECK_THROWS_WITH(t.to_vector<BFloat16>(), ContainsSubstring("bf16"));
  CHECK_THROWS_WITH(Tensor::from_vector(v, {5}), ContainsSubstring("12 values do not fill shape (5,)"));
  CHECK(t.str() == "Tensor[f32, (3, 4), cpu]");
}

TEST_CASE("views share storage, reshape and rows", "[core][tensor]") {
  std::vector<int32_t> v(24);
  std::iota(v.begin(), v.end(), 0);
  Tensor t = Tensor::from_vector(v, {4, 6});
  Tensor rows = t.slice_rows(1, 2);
  CHECK(rows.shape() == Shape{2, 6});
  CHECK(rows.shares_storage_with(t));
  CHECK(rows.to_vector<int32_t>().front() == 6);
  CHECK(rows.to_vector<int32_t>().back() == 17);
  rows.data<int32_t>()[0] = -1;  // writes through to the parent
  CHECK(t.data<int32_t>()[6] == -1);

  Tensor r = t.reshape({2, -1, 3});
  CHECK(r.shape() == Shape{2, 4, 3});
  CHECK(r.data_ptr() == t.data_ptr());
  CHECK_THROWS_WITH(t.reshape({5, -1}), ContainsSubstring("cannot infer"));
  CHECK_THROWS_WITH(t.reshape({5, 5}), ContainsSubstring("cannot reshape"));
  CHECK_THROWS_WITH(t.reshape({-1, -1}), ContainsSubstring("more than one -1"));

  Tensor w = t.view(20, {4});
  CHECK(w.to_vector<int32_t>() == std::vector<int32_t>{20, 21, 22, 23});
  CHECK_THROWS_WITH(t.view(21, {4}), ContainsSubstring("does not fit"));
  CHECK_THROWS_WITH(t.slice_rows(3, 2), ContainsSubstring("out of range"));
  CHECK(t.slice_rows(4, 0).numel() == 0);
  CHECK(t.flatten().shape() == Shape{24});
}

TEST_CASE("copies between tensors check dtype and shape", "[core][tensor]") {
  Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  Tensor b = Tensor::zeros({2, 2}, DType::f32);
  b.copy_from(a);
  CHECK(b.to_vector<float>() == std::vector<float>{1, 2, 3, 4});
  Tensor c = a.clone();
  CHECK_FALSE(c.shares_storage_with(a));
  CHECK(c.to_vector<float>() == a.to_vector<float>());
  Tensor wrong_dtype = Tensor::zeros({2, 2}, DType::bf16);
  CHECK_THROWS_WITH(wrong_dtype.copy_from(a), ContainsSubstring("dtype mismatch"));
  Tensor wrong_shape = Tensor::zeros({4}, DType::f32);
  CHECK_THROWS_WITH(wrong_shape.copy_from(a), ContainsSubstring("shape mismatch"));
  // Overlapping views copy like memmove.
  Tensor v = Tensor::from_vector(std::vector<int64_t>{0, 1, 2, 3, 4}, {5});
  Tensor dst = v.view(1, {4});
  dst.copy_from(v.view(0, {4}));
  CHECK(v.to_vector<int64_t>() == std::vector<int64_t>{0, 0, 1, 2, 3});
}

TEST_CASE("poisoning and zeroing write every byte", "[core][tensor]") {
  Tensor t = Tensor::empty({3, 5}, DType::f32);
  t.fill_bytes_(0xff);
  for (float x : t.to_vector<float>()) CHECK(std::isnan(x));
  t.zero_();
  for (float x : t.to_vector<float>()) CHECK(x == 0.f);
}

TEST_CASE("undefined tensors and CUDA requests fail clearly", "[core][tensor]") {
  Tensor u;
  CHECK_FALSE(u.defined());
  CHECK_THROWS_WITH(u.data_ptr(), ContainsSubstring("undefined tensor"));
  CHECK(u.str() == "Tensor[undefined]");
  if (cuda_device_count() == 0) {
    CHECK_THROWS_AS(Tensor::empty({4}, DType::f32, Device::cuda(0)), Error);
    CHECK_THROWS_WITH(Tensor::empty({4}, DType::f32, Device::cuda(0)), ContainsSubstring("cuda:0"));
  }
  CHECK_THROWS_AS(Tensor::empty({4}, DType::f32, Device::cuda(-1)), Error);
}

TEST_CASE("host allocator statistics track current and peak bytes", "[core][memory]") {
  const MemoryStats before = memory_stats(Device::cpu());
  reset_peak_memory_stats(Device::cpu());
  {
    Tensor a = Tensor::empty({1000}, DType::f32);  // 4000 bytes
    Tensor b = Tensor::empty({500}, DType::i64);   // 4000 bytes
    const MemoryStats during = memory_stats(Device::cpu());
    CHECK(during.current_bytes - before.current_bytes == 8000);
    CHECK(during.allocations - before.allocations == 2);
    Tensor view = a.slice_rows(0, 10);  // a view allocates nothing
    CHECK(memory_stats(Device::cpu()).current_bytes == during.current_bytes);
  }
  const MemoryStats after = memory_stats(Device::cpu());
  CHECK(after.current_bytes == before.current_bytes);
  CHECK(after.peak_bytes - before.current_bytes >= 8000);
  CHECK(after.frees - before.frees == 2);
  reset_peak_memory_stats(Device::cpu());
  CHECK(memory_stats(Device::cpu()).peak_bytes == after.current_bytes);
}

TEST_CASE("pinned buffers work without a GPU and are counted apart", "[core][memory]") {
  const MemoryStats before = pinned_memory_stats();
  {
    Tensor p = Tensor::empty_pinned({256}, DType::u8);
    CHECK(p.is_pinned());
    CHECK(p.device() == Device::cpu());
    CHECK(reinterpret_cast<uintptr_t>(p.data_ptr()) % 64 == 0);
    CHECK(pinned_memory_stats().current_bytes - before.current_bytes == 256);
    Tensor h = Tensor::from_vector(std::vector<uint8_t>(256, 7), {256});
    p.copy_from(h);
    CHECK(p.to_vector<uint8_t>() == std::vector<uint8_t>(256, 7));
  }
  CHECK(pinned_memory_stats().current_bytes == before.current_bytes);
}

TEST_CASE("errors carry the location and the condition", "[core][error]") {
  try {
    SLIME_CHECK(1 + 1 == 3, "arithmetic is ", "broken: ", 42);
    FAIL("SLIME_CHECK did not throw");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK_THAT(what, ContainsSubstring("tests/core/test_tensor.cpp:"));
    CHECK_THAT(what, ContainsSubstring("1 + 1 == 3"));
    CHECK_THAT(what, ContainsSubstring("arithmetic is broken: 42"));
    CHECK_THAT(e.message(), !ContainsSubstring("test_tensor.cpp"));
  }
}
