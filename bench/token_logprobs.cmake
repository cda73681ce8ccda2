# bench_token_logprobs: fused lm-head + log-softmax + entropy (forward and
# forward + backward, bf16, V = 151936) with time and peak device memory;
# PyTorch baseline and the side-by-side table in bench/torch_token_logprobs.py.
add_executable(bench_token_logprobs bench_token_logprobs.cu)
target_link_libraries(bench_token_logprobs PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_token_logprobs PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
