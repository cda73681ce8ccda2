# bench_packer: data::plan on 100k RL rollout lengths, Karmarkar–Karp, first-fit
# decreasing and micro-batch packing. CPU code only: it links slime::core, so
# building it compiles no kernels. Without CUDA this file is not included; the
# ctest test_data_packer_budget then checks the time budget loosely.
add_executable(bench_packer bench_packer.cpp)
target_link_libraries(bench_packer PRIVATE slime::core benchmark::benchmark)
target_include_directories(bench_packer PRIVATE ${PROJECT_SOURCE_DIR}/tests/data)
target_compile_options(bench_packer PRIVATE -Wall -Wextra)
