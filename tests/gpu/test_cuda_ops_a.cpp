#include "gpu_test_util.h"
