// Helpers shared by every kernel family (see kernels/README.md).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>
