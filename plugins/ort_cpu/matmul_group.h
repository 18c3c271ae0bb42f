// How one unispec.cpu::PackedLinear node runs its 1 to 4 weights (q, k, v; gate, up) as one stream of panels,
// and the SwiGLU it can end with (silu.h). Included by matmul.cc alone, after matmul_tiles.h.
//
// The weights' panels are laid end to end as slots (weight 0's panels, then weight 1's, ...), each slot
// saying where its 32 columns go, and the slots are split into tasks as one weight's panels were. So the
// rows of X are read once for the whole group, and a tile of several panels can take panels of different
// weights: the bundled Llama 3's q, k and v (4 + 2 + 2 panels) are one 8-panel tile at one row, where
// each alone was too narrow for one. Every output value is the same fused multiply-add chain over k, in
// order, as a single-weight node computes it (the tile shapes change only which values run side by side),
// so a group's outputs equal the separate nodes' bit for bit.

#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "silu.h"

namespace unispec_cpu {
namespace {

struct Slot {                    // one panel of one weight, and where its columns go
  const void* panel;             // [k][kPanel] float or uint16_t (float16)
  float* y;                      // row 0's first column of this panel in its output
  int64_t ldy, cols;             // the output's row stride (its N); columns of the panel in use
  bool half;
};

struct Job {
  const Slot* slots;
  const float* x;                // [rows, k]
  int64_t num_slots, rows, k, slots_per_task;
};

// The slots [at, at + np) as one wide tile (matmul_tiles.h's wide_tile): all full and of one element type
// (checked by the caller); np = panels_at_once(rows) <= 8.
template <typename W>
void run_wide(const Job& job, const Slot* slots, int64_t np) {
  const W* panels[8];
  float* ys[8];
  int64_t ldy[8];
  for (int64_t p = 0; p < np; ++p) {
    panels[p] = static_cast<const W*>(slots[p].panel);
    ys[p] = slots[p].y;
    ldy[p] = slots[p].ldy;
  }
  wide_tile<W>(job.x, job.rows, job.k, panels, ys, ldy);
}

template <typename W>
void run_one(const Job& job, const Slot& slot, int64_t kc) {
  const W* panel = static_cast<const W*>(slot.panel);
  for (int64_t k0 = 0; k0 < job.k; k0 += kc)
    rows_by_block(job.x + k0, job.rows, job.k, panel + k0 * kPanel, std::min(kc, job.k - k0), slot.y, slot.ldy,
                  slot.cols, k0 == 0, kc < job.k ? kc * kPanel : 0);
}

// Whether slots [0, np) can run as one wide tile.
bool wide_alike(const Slot* slots, int64_t np) {
  for (int64_t p = 0; p < np; ++p)
    if (slots[p].cols != kPanel || slots[p].half != slots[0].half) return false;
  return true;
}

// Slots [task · per, (task + 1) · per) for every row.
void run_task(void* data, size_t task) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t first = static_cast<int64_t>(task) * job.slots_per_task;
  const int64_t last = std::min(job.num_slots, first + job.slots_per_task);
  const int64_t kc = job.rows > kManyRows ? kKc : job.k, wide = panels_at_once(job.rows);
  for (int64_t p = first; p < last;) {
    const Slot* slots = job.slots + p;
    if (wide > 1 && p + wide <= last && wide_alike(slots, wide)) {
      if (slots->half)
        run_wide<uint16_t>(job, slots, wide);
      else
        run_wide<float>(job, slots, wide);
      p += wide;
      continue;
    }
    if (slots->half)
      run_one<uint16_t>(job, *slots, kc);
    else
      run_one<float>(job, *slots, kc);
    ++p;
  }
}

}  // namespace
}  // namespace unispec_cpu
