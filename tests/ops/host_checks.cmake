# Host checks of batch data before a launch (slime/ops/host_checks.hpp). CPU only.
slime_add_test(test_ops_host_checks LABELS ops SOURCES ops/test_host_checks.cpp)
