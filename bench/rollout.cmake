# bench_rollout: the rollout engine's generate throughput (batch 1, 32, 256);
# transformers' generate with a static cache in bench/torch_rollout.py.
add_executable(bench_rollout bench_rollout.cpp)
target_link_libraries(bench_rollout PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_rollout PRIVATE -Wall -Wextra)
