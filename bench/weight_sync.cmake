# bench_weight_sync: rollout weight sync, colocated on one GPU and across two
# (NCCL buckets), beside a plain NCCL broadcast of a bucket (the bound).
add_executable(bench_weight_sync bench_weight_sync.cpp)
target_link_libraries(bench_weight_sync PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_weight_sync PRIVATE -Wall -Wextra)
