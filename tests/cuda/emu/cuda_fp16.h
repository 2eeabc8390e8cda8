// Test support: emulated cuda_fp16.h (see cuda_emu.h).
#pragma once
#include "cuda_emu.h"
