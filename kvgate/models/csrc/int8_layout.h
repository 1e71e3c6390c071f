// The packed tile layouts of --weights gguf-q8act (kvgate.models.q4_1_dot8.q4_1_pack8 and
// kvgate.models.q8_head.q8_pack8), shared by the AVX2/scalar kernels (int8_dot.cpp) and the AVX-512
// VNNI ones (int8_vnni.cpp).
#pragma once
#include <cstdint>

namespace kvgate_int8 {

constexpr int64_t QB = 32;                            // values per block
constexpr int64_t NT = 8;                             // output rows per packed tile
constexpr int64_t NIBBLES = NT * QB / 2;              // a Q4_1 tile's code bytes per block
constexpr int64_t TILE_BLOCK = NIBBLES + 2 * NT * 2;  // then its 8 d and 8 m as fp16: 160 bytes
constexpr int64_t Q8_CODES = NT * QB;                 // a Q8_0 tile's code bytes per block
constexpr int64_t Q8_BLOCK = Q8_CODES + NT * 4;       // then its 8 float32 scales: 288 bytes

// What the activations of one call look like once rounded (int8_dot.cpp's q8_rows): M rows of K codes,
// per row and block a scale d and s = d * (sum of the block's codes).
struct Rounded {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t M, K;
};

// The AVX-512 VNNI kernels, compiled where the build has them (int8_vnni.cpp): each fills y [M, N]
// from T packed tiles, threads splitting pairs of tiles, and gives the AVX2 kernels' bits. `vnni_built`
// says whether they exist in this build; `vnni_enabled` whether calls take them (set_int8_isa): calls of
// more than 4 rows always, calls of 1-4 rows where `use_pairs` finds their bit (set_int8_small_rows).
bool vnni_built();
bool& vnni_enabled();
void q4_1_dot8_vnni(const Rounded& x, const uint8_t* w, int64_t T, int64_t N, float* y);
void q8_dot8_vnni(const Rounded& x, const uint8_t* w, int64_t T, int64_t N, float* y);
// q4_1_dot8_vnni's pairs of tiles [p0, p1) only, on the calling thread (decode_stack.cpp's thread team)
void q4_1_dot8_vnni_pairs(const Rounded& x, const uint8_t* w, int64_t T, int64_t N, float* y, int64_t p0, int64_t p1);

// The thread team's pieces of q4_1_dot8 (int8_dot.cpp), so that a decode stack's threads can share one
// parallel region: the same roundings and tiles, hence the same bits.
// - round_rows: rows [r0, r1) of x (K floats a row) as q8_rows rounds them, into q [.., K] and d, s [.., K/32]
// - use_pairs: whether q4_1_dot8 would take the VNNI pairs of tiles for M rows now (read it once, before
//   the team's region: set_int8_isa or set_int8_small_rows may flip a switch from another thread meanwhile)
// - units: how many pieces T tiles split into (pairs of tiles, or tiles); run_units runs pieces [u0, u1)
//   on the calling thread
void round_rows(const float* x, int64_t r0, int64_t r1, int64_t K, int8_t* q, float* d, float* s);
bool use_pairs(int64_t M);
int64_t units(int64_t T, bool pairs);
void run_units(const Rounded& x, const uint8_t* w, int64_t T, int64_t N, float* y, int64_t u0, int64_t u1,
               bool pairs);

}  // namespace kvgate_int8
