# bench_colocated: colocated training and rollout on one GPU, a ~0.5B dense
# Qwen3 under Sharded<FullShard> (Sharded::offload / onload) beside a
# rollout::Engine (Engine::offload / onload): peak device memory of a training
# step alone, a rollout turn alone, a colocated step and both resident, and the
# offload / onload times over PCIe. A plain program printing JSON lines (no
# Google Benchmark); skips (exit 0) without a GPU.
add_executable(bench_colocated bench_colocated.cpp)
target_link_libraries(bench_colocated PRIVATE ${SLIME_LIB})
target_compile_options(bench_colocated PRIVATE -Wall -Wextra)
