// IsoQuant split-K attention on NVIDIA tensor cores (CUDA only; its Metal counterpart is the
// scalar kernel iq_fused_scalar in isoquant_body.h, which computes the same partials).
//
// 3-bit codes, D in {64, 128}, up to 8 query rows per threadgroup (more rows: more
// threadgroups along y). Per warp and tile of IQ_TILE = 32 tokens (one online-softmax step: its
// max, shuffles and rescale vote are paid once per 32 tokens), with m16n8k16 f16 -> f32 mma:
//   S = Q K^T: A = the query rows stacked as [fp16 hi parts (rows 0-7); fp16 remainders (rows
//     8-15)], so one mma gives both halves of an ~fp32 product (the lane adds c0 + c2);
//     B = K codes, n = 8 tokens (four n-tiles per tile): 4 codes of one token -> a nibble
//     selector -> 2 byte permutes through the fp16 level table (low bytes, high bytes) -> 2
//     permutes into two half2.
//     KI8 (the K codebook on the int8 grid): m16n8k32 int8 -> int32 instead, A = [int8 part 1
//     of the query rows (row-scaled to +-127); int8 part 2 (the remainder, x254)], B = one byte
//     permute per 4 K codes into the exact int8 table; score = 254 c0 + c2, then the scales.
//   online softmax on the C fragment (one query row per lane, log2 domain); P' = p * |v|/sqrt(D)
//     is already laid out as the B fragment of the next product.
//   O^T += V^T P'^T: A = V codes (rows = 16 coordinates, k = 16 tokens; two k-steps per tile), one
//     mma per 16 coordinates and k-step: half as many mma and accumulators as O = P' V with 16
//     padded query rows.
//     PV8 (<= 4 query rows, KI8): m16n8k32 int8 -> int32 instead, one k-step per tile, A = V
//     codes of 4 tokens per register (one byte permute per 4 codes into the exact int8 table),
//     B = P' in two int8 parts (256 kappa P' = 256 part 1 + part 2; columns 0-3 part 1 of rows
//     0-3, 4-7 part 2: the query rows 4-7
//     are copies of 0-3, so each lane quantizes its own scores); see iq_pv8_sel, iq_tc_warp.
// Codes reach the selectors as the packed rows' nibble words (packing.py: codes 0-23 of a block
// by one AND per 8, codes 24-31 from the nibbles' top bits), then, for V, by pairing two tokens'
// nibbles into bytes (2 logic ops per 4 selectors). VIL: V codes in packing.py's tc16 layout hold
// 4 tokens' codes per coordinate in one nibble group, in the order of the mma's k, so a masked
// word is two PV8 selectors as it is (VSN: iq_vil_vsn spreads it). A selector word's high half reaches a permute
// through iq_hi16 (FMA pipe) rather than a shift: the tile loop is bound by the integer pipe.
// Coordinate maps (a permutation of the dot product, undone when O is stored):
//   QK: lane (gid, tig) holds codes [tig*D/4, tig*D/4 + D/4) of token 8*nt + gid (nt < 4);
//       k-step kt uses codes tig*D/4 + 4kt + {0,1} (b0) and + {2,3} (b1) (KI8: k-step ks of 32
//       uses codes tig*D/4 + 8ks + 0..3 (b0) and + 4..7 (b1)).
//   PV: lane (gid, tig) holds codes [gid*D/8, gid*D/8 + D/8) of tokens 16h + (2tig, 2tig+1,
//       2tig+8, 2tig+9) in k-step h; m-tile mt (group q = mt/4 of 8 codes, j = mt%4) has rows
//       gid -> code 8q + 4(j&1) + (j>>1) and gid + 8 -> that code + 2 (see iq_tc_vcode); VIL:
//       gid -> code 8q + 2j, gid + 8 -> 8q + 2j + 1 (iq_tc_vcode_vil).
// Partials have the layout of iq_fused_scalar (iq_combine merges either), one per threadgroup.
// The level tables arrive scaled by s (fparams[3] = 1/s for K, [4] for V), s chosen so the fp16
// table rounds the levels ~10x closer than plain fp16 would; the norms carry the 1/s back.
// iq_mma (one m16n8k16 f16 -> f32 multiply-accumulate) comes from the CUDA prologue.

// @header
// At least 4 threadgroups (16 warps) per SM: ptxas then fits the kernel in 128 registers without
// spills. MLX writes the kernel's signature itself, so the bound goes on its __global__ (this
// header is compiled with the tensor-core kernel alone). H200, side by side in one call: a bound of
// 5 (96 registers, a few spilled words) was ahead of none (~102 registers) by ~6% at first;
// with the stream below (one source pointer per lane, 32-bit shared addresses) 4 is ahead of 5:
// B8 T32K 108.2 -> 104.6 us, B32 T32K 373 -> 365, B8 T8K 38.0 -> 37.1; with 32-token tiles too
// (bound 5: 94.8 vs 92.2 us at B8 T32K; docs/kernels.md).
#if defined(__CUDACC__) && defined(__CUDA_ARCH__)
#undef __global__
#define __global__ __location__(global) __launch_bounds__(IQ_NW * 32, 4)
#endif
__device__ __forceinline__ uint32_t iq_pack_h2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// (x, y) as a half2 hi part and the half2 of what rounding left out (lo): hi + lo ~ fp32.
__device__ __forceinline__ void iq_split_h2(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = iq_pack_h2(x, y);
  const __half2 h = *reinterpret_cast<const __half2*>(&hi);
  lo = iq_pack_h2(x - __low2float(h), y - __high2float(h));
}

// Levels of 4 codes (selector nibbles c0..c3 in the low 16 bits, each < 8) as two half2
// registers: (c0, c1) and (c2, c3).
__device__ __forceinline__ void iq_lut4(uint32_t sel, const uint32_t tab[4], uint32_t& b0, uint32_t& b1) {
  const uint32_t lo = iq_prmt(tab[0], tab[1], sel);
  const uint32_t hi = iq_prmt(tab[2], tab[3], sel);
  b0 = iq_prmt(lo, hi, 0x5140);
  b1 = iq_prmt(lo, hi, 0x7362);
}

// The level tables come from the host (isoquant.py, tc_table_words; iparams[IQ_P_TAB ..]): fp16
// ones as byte planes (words 0-1: the low bytes of levels 0-7, 2-3: their high bytes), KI8's as
// the int8 levels (word 0: levels 0-3, 1: 4-7), VSN's as L + 128 bytes (iq_tc_vregs). Built per
// lane from the levels they took ~70 instructions a warp in the set-up.

// KI8: a query row's scale (its largest |value| / 127; 1 for a zero row)
__device__ __forceinline__ float iq_i8_row_scale(float m) { return m > 0.0f ? m / 127.0f : 1.0f; }

// KI8: 4 values x / sc as int8 bytes: part 1 = round(x / sc) (|.| <= 127), part 2 = round(254 *
// what part 1 left) (|.| <= 127), so x = sc * (p1 + p2 / 254) + O(sc / 508).
__device__ __forceinline__ void iq_i8_split4(const float* x, float inv, uint32_t& p1, uint32_t& p2) {
  p1 = p2 = 0u;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float u = x[j] * inv;
    const float h = fminf(fmaxf(rintf(u), -127.0f), 127.0f);
    const float l = fminf(fmaxf(rintf((u - h) * 254.0f), -127.0f), 127.0f);
    p1 |= (uint32_t(int(h)) & 0xFFu) << (8 * j);
    p2 |= (uint32_t(int(l)) & 0xFFu) << (8 * j);
  }
}

// KI8: A fragment for k-step ks (32 coordinates) of lane (gid, tig): rows gid = part 1 of query
// row gid, gid + 8 = its part 2; columns 4tig..4tig+3 (a0, a1) are codes tig*D/4 + 8ks + 0..3,
// 16 + 4tig.. (a2, a3) + 4..7: the coordinates of the K codes in the lane's b0, b1 (nibble word
// ks of iq_tc_kcodes). qm: the rows' scales.
template <int D>
__device__ __forceinline__ uint4 iq_tc_qfrag_i8(const float* qs, const float* qm, int ks, int gid,
                                                int tig) {
  const float* x = qs + gid * D + tig * (D / 4) + 8 * ks;
  const float inv = 1.0f / qm[gid];
  uint4 f;
  iq_i8_split4(x, inv, f.x, f.y);
  iq_i8_split4(x + 4, inv, f.z, f.w);
  return f;
}

__device__ __forceinline__ uint32_t iq_ld16(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}

// A pointer into shared memory held as its 32-bit shared address (the streamed stages): loads
// are ld.shared from that register plus a constant, where a generic pointer into a __shared__
// array made ptxas rebuild the array's window address every tile (S2R SR_CgaCtaId, LEA: ~10
// instructions per tile, measured under a 96-register bound).
template <typename T>
struct IqSmem {
  uint32_t a;
  __device__ __forceinline__ IqSmem operator+(long i) const {
    return {a + uint32_t(i) * uint32_t(sizeof(T))};
  }
  __device__ __forceinline__ T operator[](long i) const {
    static_assert(sizeof(T) == 2, "16-bit elements (the norms)");
    const uint16_t h = uint16_t(iq_lds16(a + uint32_t(i) * 2u));
    return *reinterpret_cast<const T*>(&h);
  }
};

// A 32-bit word at p: one load when 4-byte aligned (A4: the streamed stage rows), else two 16-bit
// loads (rows and block offsets are 2-byte aligned).
template <bool A4>
__device__ __forceinline__ uint32_t iq_tc_word(const uint8_t* p) {
  if (A4) return *reinterpret_cast<const uint32_t*>(p);
  return iq_ld16(p) | (iq_ld16(p + 2) << 16);
}
template <bool A4>
__device__ __forceinline__ uint32_t iq_tc_word(IqSmem<uint8_t> p) {  // stage rows: 4-byte aligned
  return iq_lds32(p.a);
}

// The norms of tokens t, t + 1 (t even) as the bits of a half2 (low half: token t): a full
// tile's from its stage (IqSmem, 4-byte aligned pairs; only streamed tiles are full) in one 32-bit
// load, else one load each at indices clamped to `last`.
template <bool FULL, typename P>
__device__ __forceinline__ uint32_t iq_norm_bits(P p, long stride, int t, int last) {
  if constexpr (FULL) {
    return iq_lds32(p.a + uint32_t(t) * 2u);
  } else {
    return uint32_t(__half_as_ushort(p[min(t, last) * stride])) |
           (uint32_t(__half_as_ushort(p[min(t + 1, last) * stride])) << 16);
  }
}
// The same pair as floats.
template <bool FULL, typename P>
__device__ __forceinline__ void iq_norm_pair(P p, long stride, int t, int last, float v[2]) {
  const uint32_t w = iq_norm_bits<FULL>(p, stride, t, last);
  const __half2 h = *reinterpret_cast<const __half2*>(&w);
  v[0] = __low2float(h);
  v[1] = __high2float(h);
}

// The three words of the 3-bit block at p (packing.py).
template <bool A4, typename P>
__device__ __forceinline__ void iq_tc_block(P p, uint32_t w[3]) {
  w[0] = iq_tc_word<A4>(p);
  w[1] = iq_tc_word<A4>(p + 4);
  w[2] = iq_tc_word<A4>(p + 8);
}

// Codes [16h, 16h + 16) of the 3-bit block at p (packing.py: words of nibbles, codes 24-31 in
// their top bits) as two nibble words: codes 0-7 and 8-15 (h = 0) or 16-23 and 24-31 (h = 1).
// RAW: the words as loaded, nibbles' top bits included (codes 24-31 always come clean).
template <bool A4, typename P, bool RAW = false>
__device__ __forceinline__ void iq_tc_half(P p, int h, uint32_t& s0, uint32_t& s1) {
  constexpr uint32_t M = RAW ? 0xFFFFFFFFu : 0x77777777u;
  uint32_t w[3];
  iq_tc_block<A4>(p, w);
  s0 = (h ? w[2] : w[0]) & M;
  s1 = h ? iq_top8(w[0], w[1], w[2]) : (w[1] & M);
}

// The lane's K codes of one row (codes [tig*D/4, +D/4)) as nibble words: S[i] holds codes
// 8i..8i+7 of that range (selectors as they are: nibbles < 8). A4: 4-byte aligned rows.
template <int D, bool A4, typename P>
__device__ __forceinline__ void iq_tc_kcodes(P row, int tig, uint32_t S[D / 32]) {
  if constexpr (D == 128) {
    uint32_t w[3];
    iq_tc_block<A4>(row + 12 * tig, w);  // one block of 32 codes
    S[0] = w[0] & 0x77777777u;
    S[1] = w[1] & 0x77777777u;
    S[2] = w[2] & 0x77777777u;
    S[3] = iq_top8(w[0], w[1], w[2]);
  } else {
    iq_tc_half<A4>(row + 12 * (tig >> 1), tig & 1, S[0], S[1]);
  }
}

// The lane's V codes of one row (codes [gid*D/8, +D/8)) as nibble words (D/64 of them); RAW:
// nibbles' top bits not cleared (the VSN selectors mask them anyway).
template <int D, bool A4, typename P, bool RAW = false>
__device__ __forceinline__ void iq_tc_vcodes(P row, int gid, uint32_t S[D / 64]) {
  constexpr uint32_t M = RAW ? 0xFFFFFFFFu : 0x77777777u;
  if constexpr (D == 128) {
    iq_tc_half<A4, P, RAW>(row + 12 * (gid >> 1), gid & 1, S[0], S[1]);
  } else {
    uint32_t w[3];
    iq_tc_block<A4>(row + 12 * (gid >> 2), w);  // quarter gid & 3 of a block
    const int q = gid & 3;
    const uint32_t wq = q == 0 ? w[0] : (q == 1 ? w[1] : w[2]);  // selects: no indexed (local) array
    S[0] = q == 3 ? iq_top8(w[0], w[1], w[2]) : (wq & M);
  }
}

// Row r (0: gid, 1: gid + 8) of PV m-tile mt -> index of the code in the lane's V range.
__host__ __device__ __forceinline__ int iq_tc_vcode(int mt, int r) {
  const int j = mt & 3;
  return 8 * (mt >> 2) + 4 * (j & 1) + (j >> 1) + 2 * r;
}

// VIL (V codes in the tc16 layout, packing.py): row r of PV m-tile mt -> index of the code in the
// lane's V range. Word j < 3 of the lane's block b holds coordinates 8b + 2j (low 16 bits: the
// selector of row gid) and 8b + 2j + 1 (high: row gid + 8) of its group's 4 tokens; the block's
// top codes (iq_top8) coordinates 8b + 6 and 8b + 7.
__host__ __device__ __forceinline__ int iq_tc_vcode_vil(int mt, int r) {
  return 8 * (mt >> 2) + 2 * (mt & 3) + r;
}

// VIL: the lane's 3 D/64 words of one 16-token chunk: its group tig (the chunk's tokens 2tig +
// (0, 1, 8, 9), k = 4tig .. 4tig + 3 of the PV mma) at its lane-block gid, 12 D/64 contiguous
// bytes at 12 D/64 (4 gid + tig) from the chunk's start. A stage chunk (8-byte aligned): D 128 in
// three 8-byte loads (the 8-byte slots 12 gid + 3 tig of a half-warp are distinct mod 16: no bank
// conflict), D 64 in three 4-byte ones (words 3 (4 gid + tig): 32 banks); rows read directly
// (2-byte aligned) a word at a time.
template <int D>
__device__ __forceinline__ void iq_vil_words(IqSmem<uint8_t> chunk, int gid, int tig,
                                             uint32_t w[3 * (D / 64)]) {
  const uint32_t a = chunk.a + uint32_t(12 * (D / 64) * (4 * gid + tig));
  if constexpr (D == 128) {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const uint2 v = iq_lds64(a + 8u * i);
      w[2 * i] = v.x;
      w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 3 * (D / 64); ++i) w[i] = iq_lds32(a + 4u * i);
  }
}
template <int D>
__device__ __forceinline__ void iq_vil_words(const uint8_t* chunk, int gid, int tig,
                                             uint32_t w[3 * (D / 64)]) {
  const uint8_t* p = chunk + 12 * (D / 64) * (4 * gid + tig);
#pragma unroll
  for (int i = 0; i < 3 * (D / 64); ++i) w[i] = iq_tc_word<false>(p + 4 * i);
}

// Selectors of the 4 m-tiles of one group of 8 codes, for two tokens a and b: nibbles
// (a[i], b[i], a[i+2], b[i+2]) for i = 0, 4, 1, 5 (the order of iq_tc_vcode).
__device__ __forceinline__ void iq_tc_pair(uint32_t a, uint32_t b, uint32_t sel[4]) {
  const uint32_t e = (a & 0x0F0F0F0Fu) | ((b << 4) & 0xF0F0F0F0u);  // bytes a0b0 a2b2 a4b4 a6b6
  const uint32_t o = ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u);  // bytes a1b1 a3b3 a5b5 a7b7
  sel[0] = e;
  sel[1] = e >> 16;
  sel[2] = o;
  sel[3] = o >> 16;
}

// VSN (V levels as fp16 subnormals): the level table holds one byte per code, L + 128 for the
// integer level L (|L| <= 127; codes 0-3 are the negative levels, so their bytes are < 128), and
// an A register (two tokens at one coordinate) is (L_a + 128, L_b + 128) * 2^-24: one byte
// permute with the selector (code a, 8 | i, code b, 8 | i), i < 4, whose 8 | i nibbles copy the
// sign of byte i (0) into the high bytes. The partial then holds 2^-24 sum P' (L + 128): the
// warp scales by 2^24 and takes off 128 sum P' at its end. One permute per register instead of
// two permutes per register plus the token pairing (iq_tc_pair, iq_lut4).
//
// A VSN selector pair from 4 nibbles (code, pad, code, pad) per 16 bits: codes to 3 bits, pads to
// 8 | (pad & 3). c80: 0x80808080 in a register (a LOP3 takes one immediate: (x & 0x37373737) | c80
// is then one instruction, where two immediates made ptxas emit two).
__device__ __forceinline__ uint32_t iq_vsn_mask(uint32_t x, uint32_t c80) {
  return iq_and_or<0x37373737u>(x, c80);
}

// VSN selectors of 8 codes (one nibble word each, top bits not cleared) of tokens a and b, in the
// order of iq_tc_vcode's m-tiles: sel[j] has the selector of the m-tile's row gid in its low 16
// bits, of row gid + 8 in its high 16 bits (codes (0, 2), (4, 6), (1, 3), (5, 7)).
__device__ __forceinline__ void iq_vsn_sel(uint32_t a, uint32_t b, uint32_t c80, uint32_t sel[4]) {
  const uint32_t x = iq_prmt(a, b, 0x5140);  // nibbles a0 a1 b0 b1 a2 a3 b2 b3
  const uint32_t y = iq_prmt(a, b, 0x7362);  // nibbles a4 a5 b4 b5 a6 a7 b6 b7
  sel[0] = iq_vsn_mask(x, c80);  // (a0, 8|., b0, 8|.), (a2, 8|., b2, 8|.)
  sel[1] = iq_vsn_mask(y, c80);
  sel[2] = iq_vsn_mask(x >> 4, c80);  // x >> 4: a1 b0 b1 a2 a3 b2 b3 .
  sel[3] = iq_vsn_mask(y >> 4, c80);
}

// VIL with VSN: a tc16 word (raw: the nibbles' top bits are masked here) of coordinates x (low
// 16 bits: tokens t0 .. t3) and y (high) as the VSN selector words of tokens (t0, t1), ab, and
// (t2, t3), cd: (t0, 8, t1, 8) for x in the low half, the same of y in the high half. Five
// instructions for the four selectors (iq_vsn_sel took six for four from two tokens' words).
__device__ __forceinline__ void iq_vil_vsn(uint32_t w, uint32_t c80, uint32_t& ab, uint32_t& cd) {
  const uint32_t e = iq_and_or<0x07070707u>(w, c80);       // bytes (t0 | 8), (t2 | 8), (u0 ..
  const uint32_t o = iq_and_or<0x07070707u>(w >> 4, c80);  // bytes (t1 | 8), (t3 | 8), (u1 ..
  ab = iq_prmt(e, o, 0x6240);
  cd = iq_prmt(e, o, 0x7351);
}

// The two A registers of one m-tile's selector word (rows gid, gid + 8): VSN, one permute each
// through the L + 128 byte table; else iq_lut4 through the fp16 table.
template <bool VSN>
__device__ __forceinline__ void iq_tc_vregs(uint32_t sel, const uint32_t vtab[4], uint32_t nz,
                                            uint32_t& lo, uint32_t& hi) {
  if constexpr (VSN) {
    lo = iq_prmt(vtab[0], vtab[1], sel);
    hi = iq_prmt(vtab[0], vtab[1], iq_hi16(sel, nz));
  } else {
    iq_lut4(sel, vtab, lo, hi);
  }
}

// PV8 (P V on the int8 tensor cores, m16n8k32: the whole tile is one k-step): an A register
// holds the levels of 4 tokens at one coordinate, one byte permute through the exact int8 V
// table. Selectors from 4 tokens' nibble words (codes c0..c7 of the lane's range, nibbles' top
// bits raw): W[j] has the selector (t0, t1, t2, t3) of coordinate x_j in its low 16 bits and of
// y_j in its high 16 bits, (x_j, y_j) = (0, 2), (4, 6), (1, 3), (5, 7): iq_tc_vcode's m-tiles.
// Bytes of e01 / o01 pair tokens 0 and 1 at the even / odd coordinates (only t1 and t3 are
// masked: t0's and t2's top bits never reach a selector); 14 instructions per 32 codes, as VSN's
// selectors took for 32, with half the lookups.
__device__ __forceinline__ void iq_pv8_sel(uint32_t t0, uint32_t t1, uint32_t t2, uint32_t t3,
                                           uint32_t W[4]) {
  const uint32_t m1 = t1 & 0x77777777u, m3 = t3 & 0x77777777u;
  const uint32_t e01 = iq_bitsel<0x07070707u>(t0, iq_shl4(m1));
  const uint32_t o01 = iq_bitsel<0x07070707u>(t0 >> 4, m1);
  const uint32_t e23 = iq_bitsel<0x07070707u>(t2, iq_shl4(m3));
  const uint32_t o23 = iq_bitsel<0x07070707u>(t2 >> 4, m3);
  W[0] = iq_prmt(e01, e23, 0x5140);
  W[1] = iq_prmt(e01, e23, 0x7362);
  W[2] = iq_prmt(o01, o23, 0x5140);
  W[3] = iq_prmt(o01, o23, 0x7362);
}

// PV8: 4 quantized P' values (iq_pv8_quant's words) as one B register: byte `sel` of each
// word (sel: 0x0040 takes byte 0 of each, 0x0051 byte 1; the lane's part, iq_pv8_quant).
__device__ __forceinline__ uint32_t iq_pv8_pack(uint32_t y0, uint32_t y1, uint32_t y2, uint32_t y3,
                                                uint32_t sel) {
  return iq_prmt(iq_prmt(y0, y1, sel), iq_prmt(y2, y3, sel), 0x5410);
}

// PV8: y = c v = 256 x, x in [0, 127], as a word holding the lane's int8 part of x in one byte.
// One rounding, R = round(y) (to nearest, ties to even, as the reference's np.rint), then R =
// 256 part 1 + part 2: part 1 = (R + 128) >> 8 in [0, 127] (lanes of rows 0-3: off = 1.5 * 2^23
// + 128, the word's byte 1), part 2 = R - 256 part 1 in [-128, 127], R's low byte as an int8
// (rows 4-7: off = 1.5 * 2^23, byte 0). Adding 1.5 * 2^23 rounds to an integer in the low
// mantissa bits (the offset's low 22 bits are 0 but for the 128, so y + off's bits are
// 0x4B400000 + R (+ 128)). The parts of a row's two lanes come from the same c and v, so they
// always sum to R / 256. One instruction a value: iq_pv8_pack's byte permutes pick the part
// (x rounded once, then round(x) and round(254 (x - round(x))) took four; a shift by 8 for the
// part-1 lanes, before the pack took byte 0, took two).
__device__ __forceinline__ uint32_t iq_pv8_quant(float c, float v, float off) {
  return __float_as_uint(fmaf(c, v, off));
}

// A fragment of Q for k-step kt of lane (gid, tig): (hi, lo) of query row gid at codes
// tig*D/4 + 4kt + {0,1} and + {2,3} (lo = the fp16 rounding remainder, 0 without QLO).
template <int D, bool QLO>
__device__ __forceinline__ uint4 iq_tc_qfrag(const float* qs, int kt, int gid, int tig) {
  const float* x = qs + gid * D + tig * (D / 4) + 4 * kt;
  uint4 f;
  uint32_t l01, l23;
  iq_split_h2(x[0], x[1], f.x, l01);
  iq_split_h2(x[2], x[3], f.z, l23);
  f.y = QLO ? l01 : 0u;
  f.w = QLO ? l23 : 0u;
  return f;
}

// The forward rotation of the threadgroup's RB query rows, by warps and shuffles: no barriers
// (the threadgroup version, iq_rotate_rows, takes ~10). D/4 lanes per row, lane j holding
// coordinates 4j..4j+3 (one SO(4) block): iq_wht_row_warp (KIND 0), then block j (KIND 0 and 1).
// blocks: head h's [D/4][4][4] in shared memory. Rows are scaled by `post` on the way out. Only
// the block's nrows query rows are rotated (the rest are zero: decode's 4 query rows per KV head
// fill half of the 8), so a warp pass over rows past them only writes what they would have.
// Without qf the rows are rotated in place. KI8 (qf, qm): each row's int8 scale (iq_i8_row_scale
// of its largest |value|) to qm, and its Q K^T A fragments straight from the registers to qf
// ([D/32][32] uint4, iq_tc_qfrag_i8's layout: lane j's 4 coordinates are half (4j % (D/4)) / 4 of
// k-step (4j % (D/4)) / 8 at tig 4j / (D/4)); x is then not written. (The fragments were built in
// a pass of their own after a barrier: H200, B8 T8K, a per-warp %globaltimer trace: rotation 1.95
// us over two passes, fragments 0.67 us, two barriers ~0.35 us; this one pass ~1.3 us. The same
// rotation with 8 lanes per row, decode's 4 rows in one warp, took 1.6-2.4 us.)
// DUP (KI8, nrows <= 4): rows 4-7 of the fragments and scales are copies of rows 0-3, stored
// with them (PV8's A rows: the lanes of row r + 4 compute row r's scores, then quantize its P'
// part 2); the passes over rows 4-7 are skipped.
// The caller puts a barrier before the rows or fragments are read by other warps.
template <int D, int RB, int KIND, bool DUP = false>
__device__ __forceinline__ void iq_rotate_rows_warp(float* x, const float* blocks, float post,
                                                    int warp, int lane, float* qm, uint4* qf,
                                                    int nrows) {
  constexpr int LPR = D / 4;       // lanes per row
  constexpr int RPW = 32 / LPR;    // rows per warp pass
  const int sub = lane / LPR;      // row within the pass
  const int j = lane % LPR;        // block of this lane
  // KI8: where this lane's 4 coordinates go in the row's fragments (32-bit words of qf)
  const int fw = ((((4 * j) % (D / 4)) / 8) * 32 + (4 * j) / (D / 4)) * 4 + (((4 * j) % 8) / 4) * 2;
  for (int r0 = warp * RPW; r0 < RB; r0 += IQ_NW * RPW) {
    if (DUP && r0 >= 4) break;  // (warp-uniform)
    const int rr = r0 + sub;
    uint2* frag = reinterpret_cast<uint2*>(reinterpret_cast<uint32_t*>(qf) + fw + 16 * rr);
    if (r0 >= nrows) {  // the whole pass is past the block's rows (warp-uniform)
      if (qf != nullptr) {
        *frag = make_uint2(0u, 0u);
        if (j == 0) qm[rr] = 1.0f;
        if (DUP) {
          frag[32] = make_uint2(0u, 0u);  // row rr + 4: 64 words on
          if (j == 0) qm[rr + 4] = 1.0f;
        }
      }
      continue;
    }
    float* row = x + rr * D + 4 * j;
    const float4 in = *reinterpret_cast<const float4*>(row);
    float v[4] = {in.x, in.y, in.z, in.w};
    if (KIND == 0) iq_wht_row_warp<D>(v, j);
    const float* mb = blocks + 16 * j;
    float y[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      y[a] = (mb[4 * a] * v[0] + mb[4 * a + 1] * v[1] + mb[4 * a + 2] * v[2] + mb[4 * a + 3] * v[3]) *
             post;
    }
    if (qf == nullptr) {
      *reinterpret_cast<float4*>(row) = make_float4(y[0], y[1], y[2], y[3]);
    } else {  // KI8: the row's scale from its largest |value| (its LPR lanes), then its fragments
      float m = fmaxf(fmaxf(fabsf(y[0]), fabsf(y[1])), fmaxf(fabsf(y[2]), fabsf(y[3])));
#pragma unroll
      for (int o = LPR / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float sc = iq_i8_row_scale(m);
      if (j == 0) qm[rr] = sc;
      uint2 f;
      iq_i8_split4(y, 1.0f / sc, f.x, f.y);
      *frag = f;
      if (DUP) {
        frag[32] = f;
        if (j == 0) qm[rr + 4] = sc;
      }
    }
  }
}

template <bool B>
struct IqBool {
  static constexpr bool value = B;
};

// Tokens of a tile: one online-softmax step (its max, shuffles, rescale vote) per IQ_TILE tokens;
// Q K^T in IQ_TILE / 8 n-tiles of 8 tokens, P V in IQ_TILE / 16 k-steps of 16.
#define IQ_TILE 32
// Bytes of one pipeline stage: the K and V codes of a tile, then its K and V norms.
template <int D>
struct IqStage {
  static constexpr int KROW = 3 * D / 8;            // bytes of a packed row
  static constexpr int TK = IQ_TILE * KROW;         // codes of a tile
  static constexpr int BYTES = 2 * TK + 4 * IQ_TILE;  // + the tile's fp16 norms of K and of V
};
// Stages per warp: the tile being read and the next one in flight (its HBM latency hides behind
// this tile's decode and mma). H200, side by side: 2 stages of 32 tokens were ahead of 3 (B8 T32K
// 92.2 vs 93.2 us, B8 T8K 33.3 vs 34.5); 4 would pass 48 KB of static shared memory.
#define IQ_STAGES 2

IQ_FN bool iq_aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Whether a warp's compressed tokens from t0 on stream through its cp.async stages: contiguous
// rows and norms, 16-byte aligned at t0 (other layouts, e.g. views with odd strides, are read
// directly by the tile loop).
template <int D>
__device__ __forceinline__ bool iq_tc_streams(const uint8_t* stage, const uint8_t* kc, long ks,
                                              const __half* kn, long kns, const uint8_t* vc,
                                              long vs, const __half* vn, long vns, int t0) {
  constexpr int KROW = IqStage<D>::KROW;
  return stage != nullptr && ks == KROW && vs == KROW && kns == 1 && vns == 1 &&
         iq_aligned16(kc + long(t0) * KROW) && iq_aligned16(vc + long(t0) * KROW) &&
         iq_aligned16(kn + t0) && iq_aligned16(vn + t0);
}

// The float window's tokens in the scalar warp walk (iq_warp_attend), read in vector loads:
// lane j's K row in 16-byte loads (IqFloat reads it one element at a time: each of those loads
// touches 32 rows, 8-16x the L1 wavefronts and round trips), a token's V coordinates of a lane
// in one load of CPL elements. Taken when the rows are 16-byte aligned (iq_float_vec). A kind of
// IqFloat: what it does not read differently (the value weight) is IqFloat's.
struct IqFloatVec : IqFloat {};

// n elements of a row, 16-byte aligned (or n * sizeof(T)-aligned below 16 bytes), as floats
template <int N, typename T>
__device__ __forceinline__ void iq_ld_row(const T* p, float* f) {
  constexpr int BYTES = N * int(sizeof(T));
  constexpr int E = 16 / int(sizeof(T));
  if constexpr (BYTES >= 16) {
    for (int i = 0; i < BYTES / 16; ++i) {
      const uint4 w = reinterpret_cast<const uint4*>(p)[i];
      const T* e = reinterpret_cast<const T*>(&w);
      for (int k = 0; k < E; ++k) f[i * E + k] = float(e[k]);
    }
  } else if constexpr (BYTES == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&w);
    for (int k = 0; k < N; ++k) f[k] = float(e[k]);
  } else if constexpr (BYTES == 4) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    const T* e = reinterpret_cast<const T*>(&w);
    for (int k = 0; k < N; ++k) f[k] = float(e[k]);
  } else {
    for (int k = 0; k < N; ++k) f[k] = float(p[k]);
  }
}

// a float row of D elements into L1 (iq_prefetch: one request per 128-byte line)
template <int D, typename T>
__device__ __forceinline__ void iq_prefetch_row(const T* p) {
  for (int e = 0; e < D * int(sizeof(T)); e += 128) {
    iq_prefetch(reinterpret_cast<const char*>(p) + e);
  }
}

template <typename T>
__device__ __forceinline__ bool iq_float_vec(const T* kf, long ks, const T* vf, long vs) {
  return iq_aligned16(kf) && iq_aligned16(vf) && (ks * long(sizeof(T))) % 16 == 0 &&
         (vs * long(sizeof(T))) % 16 == 0;
}

// The threadgroup's RB query rows into x ([RB][D] floats, rows past R zero). Decode (L == 1) with
// unit-stride, 16-byte aligned rows: one 16-byte load per thread and chunk, rows at row0 + r * rs;
// else iq_load_q_rows (an element at a time, four 64-bit stride products each: ~45 instructions
// per element, ~360 of the set-up's ~1070 per warp at B8 T8K).
template <int D, int RB, int NTH, typename T, typename PS>
__device__ __forceinline__ void iq_tc_load_q_rows(float* x, const T* q, PS qst, int b, int h,
                                                  int r0, int R, int G, int L, int tid) {
  constexpr int E = 16 / int(sizeof(T));  // elements per chunk
  constexpr int NCH = RB * D / E;
  const T* row0 = q + b * qst[0] + (h * G + r0) * qst[1];
  const long rs = qst[1];
  if (L == 1 && qst[3] == 1 && iq_aligned16(row0) && (rs * long(sizeof(T))) % 16 == 0) {
#pragma unroll
    for (int i = tid; i < NCH; i += NTH) {
      const int r = i / (D / E);
      float f[E];
      if (r0 + r < R) {
        iq_ld_row<E>(row0 + r * rs + (i % (D / E)) * E, f);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) f[e] = 0.0f;
      }
#pragma unroll
      for (int e = 0; e < E; e += 4) {
        *reinterpret_cast<float4*>(x + i * E + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
      }
    }
  } else {
    iq_load_q_rows<D, RB, NTH>(x, q, qst, b, h, r0, R, G, L, tid);
  }
}

// s[r] += <qs[r], k_j>, the row in chunks of 64 bytes (all loads of a chunk before its FMAs)
template <int D, int RB, int KB, typename T, typename PKN>
__device__ __forceinline__ void iq_token_scores(IqFloatVec, float* s, const float* qs,
                                                const float* lvk, const T* kc, long ks, PKN kn,
                                                long kns, int j) {
  constexpr int C = 64 / int(sizeof(T)) < D ? 64 / int(sizeof(T)) : D;
  for (int c0 = 0; c0 < D; c0 += C) {
    float k[C];
    iq_ld_row<C>(kc + j * ks + c0, k);
    for (int r = 0; r < RB; ++r) {
      float acc = s[r];
      for (int e = 0; e < C; ++e) acc += qs[r * D + c0 + e] * k[e];
      s[r] = acc;
    }
  }
}

template <int D, int VB, typename T>
__device__ __forceinline__ void iq_token_values(IqFloatVec, float* v, const float* lvv,
                                                const T* vc, long vs, int j, int lane) {
  constexpr int CPL = D / 32;
  iq_ld_row<CPL>(vc + j * vs + lane * CPL, v);
}

// The cp.async stream of one warp's compressed tokens [t0, t1): tile i (tokens t0 + IQ_TILE i ..)
// goes to stage i % IQ_STAGES, tiles issued in order. Lanes 0-15 copy the tile's K codes, lanes
// 16-31 its V codes: 16-byte chunks (lane & 15) + 16r, i.e. one source pointer per lane with the
// chunks at fixed offsets from it (a full tile: NCH copies, one pointer add); lanes below NN copy
// the norms (K, then V: 8 per lane). Destinations are 32-bit shared addresses set up once. The
// last, partial tile clamps every chunk to the segment's end and zero-fills the rest, so the last
// row of a buffer is safe.
template <int D, bool VIL = false>
struct IqStream {
  static constexpr int KROW = IqStage<D>::KROW;
  static constexpr int TK = IqStage<D>::TK;
  static constexpr int SB = IqStage<D>::BYTES;
  static constexpr int NCH = TK / 256;  // chunks per lane and tile (TK / 16 of them, 16 lanes)
  static constexpr int NN = IQ_TILE / 4;  // lanes that copy norms: 8 each
  static_assert(TK % 256 == 0, "a tile's codes are whole rounds of 16 lanes x 16 bytes");
  uint32_t sdst;        // this lane's first chunk in stage 0
  uint32_t snorm;       // lanes < NN: their norm chunk in stage 0
  const uint8_t* src;   // this lane's first chunk in tile `next`
  const __half* nsrc;   // lanes < NN: 8 norms of tile `next`
  int left;             // tokens from tile `next` to the segment's end
  int next;
  int lane;

  __device__ __forceinline__ IqStream(uint8_t* stage, const uint8_t* kc, const __half* kn,
                                      const uint8_t* vc, const __half* vn, int t0, int t1,
                                      int lane_)
      : left(t1 - t0), next(0), lane(lane_) {
    const uint32_t s0 = iq_smem(stage);
    const int c = lane & 15;
    sdst = s0 + (lane < 16 ? 0 : TK) + 16 * c;
    snorm = s0 + 2 * TK + 16 * (lane % NN);
    src = (lane < 16 ? kc : vc) + long(t0) * KROW + 16 * c;
    nsrc = ((lane % NN) < NN / 2 ? kn : vn) + t0 + 8 * (lane % (NN / 2));
  }

  __device__ __forceinline__ void issue() {
    const uint32_t st = (uint32_t(next) % IQ_STAGES) * SB;
    const int c = lane & 15;
    if (left >= IQ_TILE) {
#pragma unroll
      for (int r = 0; r < NCH; ++r) iq_cp_async16s(sdst + st + 256 * r, src + 256 * r, 16);
      if (lane < NN) iq_cp_async16s(snorm + st, nsrc, 16);
    } else {
      const uint8_t* first = src - 16 * c;  // the tile's first row: inside the segment
      // bytes of the segment from the tile's start (VIL: V's whole 16-token chunks, whose rows
      // the codes array holds: packing.py's tc16)
      const int rem = (VIL && lane >= 16 ? (left + 15) & ~15 : left) * KROW;
#pragma unroll
      for (int r = 0; r < NCH; ++r) {
        const int b = rem - 16 * (c + 16 * r);
        const int bytes = b <= 0 ? 0 : (b >= 16 ? 16 : b);
        iq_cp_async16s(sdst + st + 256 * r, bytes > 0 ? src + 256 * r : first, bytes);
      }
      if (lane < NN) {
        const int q = lane % (NN / 2);  // norms 8q .. 8q + 7 of the tile
        const int b = 2 * (left - 8 * q);
        const int bytes = b <= 0 ? 0 : (b >= 16 ? 16 : b);
        iq_cp_async16s(snorm + st, bytes > 0 ? nsrc : nsrc - 8 * q, bytes);
      }
    }
    src += TK;
    nsrc += IQ_TILE;
    left -= IQ_TILE;
    ++next;
  }

  // The first IQ_STAGES - 1 tiles, one commit group each. The kernel calls it before the query
  // set-up (PF), or iq_tc_warp does when its caller has not.
  __device__ __forceinline__ void prologue() {
#pragma unroll
    for (int i = 0; i < IQ_STAGES - 1; ++i) {
      if (left > 0) issue();
      iq_cp_commit();
    }
  }
};

// Where coordinate d of query row r sits in a row of the warps' merge (iq_tc_warp's end): rows
// of IQ_MROW = D + 16 floats, d at d + iq_tc_moff(d, r). The offset is the same for every
// accumulator of one lane (rows 2tig + e, coordinates gid * D/8 + c: 4 (d / 32) + tig), so a
// lane's 32 stores are two bases plus constant offsets, and a store of one accumulator by the 32
// lanes hits 32 banks (16 (gid & 1) + 4 (gid / 2) + tig at D 128, 8 (gid & 3) + 4 (gid / 4) +
// tig at D 64; rows 2tig + e are 16 (e) apart mod 32); rows read along d stay conflict-free. The
// plain index put them on 2 banks (16-way conflicts); an XOR swizzle (d ^ (d / 32, r / 2), H200:
// B8 T8K 25.49 -> 25.38 us) fixed that but took ~2
// integer instructions an address, ~100 a warp.
template <int D>
constexpr int IQ_MROW = D + 16;
template <int D>
__host__ __device__ __forceinline__ int iq_tc_moff(int d, int r) {
  return 4 * (d >> 5) + (r >> 1);
}

// Threadgroup roles: the grid is [row blocks of every (batch, KV head)] x [splits] (blockIdx.x,
// .y), so the linear block id runs rows first, splits last: a row block's splits are spread over
// the grid (and over the threadgroups' ages on their SMs) rather than started side by side on
// neighbouring SMs (H200, side by side: B8 T8K
// 27.7 -> 26.6 us, B8 T32K 75.7 -> 74.2, B32 T8K 76.8 -> 75.7, B32 T2K 26.9 -> 26.3, B8 T2K 13.6
// -> 13.2; B = 1 within 0.3 us either way), and the float window's splits (y >= NCB) come after
// every compressed one, so the block scheduler (which starts threadgroups in that order) starts
// them last (B8 T8K, 64 float tokens: 41.5 us with them among the compressed ones, 36.7 after).
// No integer division where a (batch, KV head) has one row block (decode: R <= 8).
__device__ __forceinline__ void iq_tc_place(int R, int& bx, int& by, int& bz) {
  bx = int(blockIdx.y);
  const int f = int(blockIdx.x);
  if (R <= 8) {
    by = 0;
    bz = f;
  } else {
    const int nrb = (R + 7) / 8;
    by = f % nrb;
    bz = f / nrb;
  }
}

// One warp over compressed tokens [t0, t1) for query rows r0 .. r0+7 (qs: [8][D], rows >= R
// zero); then the threadgroup's warps (all of them call this) merge and write one partial.
// stage: this warp's IQ_STAGES * IqStage<D>::BYTES of shared memory; stream: its cp.async stream
// into them, used when `streams` (contiguous, aligned rows: iq_tc_streams), else the rows are
// read directly; prefetched: the stream's prologue was issued by the caller. (A reference, not
// a pointer that may be null: the struct then stays in registers, not local memory.) ip, fp: the
// kernel's integer and float parameters (the partial's place and scale, read after the loop).
template <int D, bool QLO, bool PLO, bool QS, bool KI8, bool VSN, bool PV8, bool VIL>
__device__ __forceinline__ void iq_tc_warp(
    const float* qs, const uint4* qf, const float* qm, const uint32_t* tab, const uint8_t* kc, long ks,
    const __half* kn, long kns, const uint8_t* vc, long vs, const __half* vn, long vns, int t0,
    int t1, int lane, float kinv, const float* fp, uint8_t* stage, float* red, float* po,
    float* pm, float* pl, const int* ip, IqStream<D, VIL>& stream, bool streams, bool prefetched) {
  static_assert(!VIL || PV8 || VSN, "V codes in the tc16 layout take the int8 table (PV8, VSN)");
  constexpr int KT = D / 16;  // k-steps of QK
  constexpr int MT = D / 16;  // m-tiles of PV (16 coordinates each)
  constexpr int NKS = D / 32;  // nibble words of the lane's K codes
  constexpr int NVS = D / 64;  // nibble words of the lane's V codes
  constexpr int KROW = IqStage<D>::KROW;
  constexpr int TK = IqStage<D>::TK;
  constexpr int SB = IqStage<D>::BYTES;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const float NEG_INF = __int_as_float(0xff800000);
  // (tab holds the 8 words twice and odd lanes read the second copy: read at one address, the
  // words went to uniform registers, copied to ordinary ones before each permute: +166
  // instructions in the tile loop)
  const uint32_t tab_s = iq_smem(tab) + 32u * uint32_t(lane & 1);
  uint32_t ktab[4], vtab[4], k8[2];
  if (KI8) {
    k8[0] = iq_lds32(tab_s);
    k8[1] = iq_lds32(tab_s + 4u);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) ktab[i] = iq_lds32(tab_s + 4u * i);
  }
  // VSN: 0x80808080 as a value ptxas cannot fold back into an immediate (the positive levels'
  // bytes are >= 128)
  uint32_t c80 = 0u;
  if (PV8 || VSN) {  // two words: 8 byte levels
    vtab[0] = iq_lds32(tab_s + 16u);
    vtab[1] = iq_lds32(tab_s + 20u);
    if (VSN) c80 = vtab[1] & 0x80808080u;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) vtab[i] = iq_lds32(tab_s + 16u + 4u * i);
  }
  const uint32_t nz = iq_neg_zero2();  // for iq_hi16
  // KI8: the integer score is in units of the query row's scale / 254
  const float kmul = KI8 ? kinv * qm[gid] * (1.0f / 254.0f) : kinv;
  // A fragments of Q: row gid = fp16 part of query row gid, row gid + 8 = its remainder.
  // QS: read per k-step from the threadgroup's copy qf ([KT][32] uint4) instead of registers
  // (KI8: always, [D/32][32] int8 fragments).
  uint32_t qa[QS || KI8 ? 1 : KT][4];
  if (!QS && !KI8) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const uint4 f = iq_tc_qfrag<D, QLO>(qs, kt, gid, tig);
      qa[kt][0] = f.x;
      qa[kt][1] = f.y;
      qa[kt][2] = f.z;
      qa[kt][3] = f.w;
    }
  }
  // O^T accumulators: m-tile mt, (c0, c1) = coordinate row gid, query rows 2tig, 2tig+1;
  // (c2, c3) = coordinate row gid + 8
  float o[PV8 ? 1 : MT][4];
  // PV8: the accumulators in int32, columns 0-3 = part 1 of query rows 0-3, 4-7 = part 2 (a
  // lane's (c0, c1) are columns 2tig, 2tig+1), in units of 1/kappa (part 2: 1/(256 kappa)) where
  // P' = p |v| is quantized as kappa P' = part 1 + part 2 / 256, kappa = 127 / nu and nu (a
  // power of two) bounds the V norms seen so far: a tile with a larger norm, like one with a
  // larger maximum score, rescales the accumulators (rounded back to integers).
  int oi[PV8 ? MT : 1][4];
#pragma unroll
  for (int mt = 0; mt < (PV8 ? 1 : MT); ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
#pragma unroll
  for (int mt = 0; mt < (PV8 ? MT : 1); ++mt) oi[mt][0] = oi[mt][1] = oi[mt][2] = oi[mt][3] = 0;
  float m = NEG_INF, l = 0.0f;  // running max and sum of query row gid (l: this lane's tokens)
  float ps = 0.0f;  // VSN: sum of this lane's P' (query row gid), rescaled with the accumulators
  // PV8: nu's fp16 bits in both halves (0: no tile yet), log2(256 kappa) (the units of P' and
  // of the sums; kappa 1 before the first tile), and this lane's part: rows 0-3 (gid < 4)
  // quantize part 1, their copies in rows 4-7 part 2
  uint32_t nu2 = 0u;
  float lk8 = 8.0f;
  const float poff = gid >= 4 ? 12582912.0f : 12583040.0f;  // iq_pv8_quant's offset and byte
  const uint32_t psel = gid >= 4 ? 0x0040u : 0x0051u;

  // One tile of IQ_TILE tokens: rows of token i at kc_ + i*ks_ etc.; tokens >= nv are masked.
  // full: IqBool<true> when nv == IQ_TILE (no clamps, no masks). kc_ .. vn_: global pointers, or
  // IqSmem ones into a stage.
  auto step = [&](auto full, auto kc_, long ks_, auto kn_, long kns_, auto vc_, long vs_, auto vn_,
                  long vns_, int nv) {
    constexpr bool FULL = decltype(full)::value;
    constexpr int NT = IQ_TILE / 8;  // n-tiles of Q K^T (8 tokens each)
    const int last = FULL ? IQ_TILE - 1 : nv - 1;
    auto tok = [&](int t) { return FULL ? t : min(t, last); };
    float c[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
    if constexpr (KI8) {
      // one int8 mma per 32 coordinates and 8 tokens; b0, b1 = codes 0-3, 4-7 of nibble word ks
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t S[NKS];
        iq_tc_kcodes<D, FULL>(kc_ + tok(8 * nt + gid) * ks_, tig, S);
        int ci[4] = {0, 0, 0, 0};
#pragma unroll
        for (int ks = 0; ks < D / 32; ++ks) {
          const uint4 f = qf[ks * 32 + lane];
          const uint32_t b0 = iq_prmt(k8[0], k8[1], S[ks]);
          const uint32_t b1 = iq_prmt(k8[0], k8[1], iq_hi16(S[ks], nz));
          iq_imma(ci, f.x, f.y, f.z, f.w, b0, b1);
        }
        c[nt][0] = float(254 * ci[0] + ci[2]);  // |.| < 2^31 for D <= 128
        c[nt][1] = float(254 * ci[1] + ci[3]);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t S[NKS];
        iq_tc_kcodes<D, FULL>(kc_ + tok(8 * nt + gid) * ks_, tig, S);
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          uint32_t a0_, a1_, a2_, a3_;
          if (QS) {
            const uint4 f = qf[kt * 32 + lane];
            a0_ = f.x, a1_ = f.y, a2_ = f.z, a3_ = f.w;
          } else {
            a0_ = qa[QS ? 0 : kt][0], a1_ = qa[QS ? 0 : kt][1];
            a2_ = qa[QS ? 0 : kt][2], a3_ = qa[QS ? 0 : kt][3];
          }
          uint32_t b0, b1;
          iq_lut4(S[kt >> 1] >> (16 * (kt & 1)), ktab, b0, b1);
          iq_mma(c[nt], a0_, a1_, a2_, a3_, b0, b1);
        }
        c[nt][0] += c[nt][2];
        c[nt][1] += c[nt][3];
      }
    }
    // columns of this lane: tokens 8nt + 2tig + e; s (in c[nt][e]) and the V weights: their V
    // norms as the half2 they are stored in (masked tokens keep a clamped row's norm: their p is
    // 0). The factor vsc goes on the merged partial in fp32: in P' = p |v| vsc (~0.002 p |v|)
    // the fp16 operand fell into the subnormal range for p below ~0.003 (H200 table's problem:
    // relative error 2.7e-4 with it in P', 5.4e-5 without).
    // The scores without kmul (> 0): it goes on after the maximum, and into the exponents' FFMA
    // (c kv kmul - base took two multiplies and a subtraction a score). The maximum as a tree
    // (depth 3, not a chain of 8): it heads the tile's chain of dependent steps.
    uint32_t nvs[NT];
    static_assert(NT == 4, "the maximum's tree");
    float cm[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float kv[2];  // the K norms of tokens 8nt + 2tig + (0, 1)
      iq_norm_pair<FULL>(kn_, kns_, 8 * nt + 2 * tig, last, kv);
      nvs[nt] = iq_norm_bits<FULL>(vn_, vns_, 8 * nt + 2 * tig, last);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = FULL || 8 * nt + 2 * tig + e < nv;
        c[nt][e] = ok ? c[nt][e] * kv[e] : NEG_INF;
      }
      cm[nt] = fmaxf(c[nt][0], c[nt][1]);
    }
    // PV8: nu's growth (a shift of the accumulators too, by gj) first: it depends on the V norms
    // alone, so lk8 is final before the scores' maximum is, and the vote on the accumulators'
    // shift can wait until just before the P V mma, after the V codes' selectors are built. With
    // one vote for both after the maximum, ptxas kept the V codes' reads and selectors below that
    // branch, behind the maximum's shuffles, the ceiling and the vote (H200, side by side: B8 T8K
    // 24.66 -> 24.46 us, B8 T32K 69.24 -> 68.66; docs/kernels.md).
    int gj = 0;
    if constexpr (PV8) {
      // a V norm of the tile above nu (positive fp16 bits order as unsigned integers)
      const uint32_t vmx = __vmaxu2(__vmaxu2(nvs[0], nvs[1]), __vmaxu2(nvs[2], nvs[3]));
      const bool grow = __vmaxu2(vmx, nu2) != nu2;
      if (__any_sync(0xffffffffu, grow)) {  // nu: the next power of two over the tile's norms
        // (the low halves: the maxima of both halves and of the tig lanes, then >= 2^-14)
        uint32_t u = __vmaxu2(vmx, vmx >> 16);
        u = __vmaxu2(u, __shfl_xor_sync(0xffffffffu, u, 1));
        u = __vmaxu2(u, __shfl_xor_sync(0xffffffffu, u, 2));
        const uint32_t nn = ((__vmaxu2(u, 0x0400u) & 0xFFFFu) + 0x03FFu) & 0x7C00u;
        // nu = 2^(e - 15) for the exponent bits e; kappa's ratio is 2^-(e - e0) once nu was
        // set (e0 > 0: the shift from the integer exponents, not from the rounded lk8)
        const int e = int(nn >> 10), e0 = int((nu2 >> 10) & 0x1Fu);
        const float lkn8 = 14.98868468677f - float(e - 15);  // log2(256 * 127 / nu)
        gj = e0 == 0 ? 0 : min(e - e0, 31);  // (before nu was set the accumulators are 0)
        l *= exp2f(lkn8 - lk8);
        lk8 = lkn8;
        nu2 = nn | (nn << 16);
      }
    }
    float mx = fmaxf(fmaxf(cm[0], cm[1]), fmaxf(cm[2], cm[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float n = fmaxf(m, mx * kmul);
    // PV8: the running maximum is kept as an integer (its ceiling: p <= 1 still, 1 bit of the
    // int8 range given up), so a rescale is a power of two, an arithmetic shift of the integer
    // accumulators, and a rarer one
    const float base = n == NEG_INF ? 0.0f : PV8 ? ceilf(n) : n;
    const float a = iq_ex2(m - base);
    int k0 = 0, k1 = 0;
    if constexpr (PV8) {
      // shift of this lane's row (31: the first tile, whose accumulators are 0)
      const int kr = m == NEG_INF ? 31 : int(base - m);
      m = n == NEG_INF ? n : base;
      // columns 2tig, 2tig+1 are query rows (2tig) & 3, (2tig+1) & 3: shifts from lanes 4 * row
      k0 = __shfl_sync(0xffffffffu, kr, 4 * ((2 * tig) & 3));
      k1 = __shfl_sync(0xffffffffu, kr, 4 * ((2 * tig + 1) & 3));
    } else {
      m = n;
    }
    // PV8: 256 p kappa (the sum l too is in units of 1/(256 kappa))
    const float pbase = PV8 ? base - lk8 : base;
    float lsum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      c[nt][0] = iq_ex2(fmaf(c[nt][0], kmul, -pbase));
      c[nt][1] = iq_ex2(fmaf(c[nt][1], kmul, -pbase));
      lsum += c[nt][0] + c[nt][1];
    }
    l = l * a + lsum;
    if (VSN) ps *= a;
    if constexpr (!PV8) {
      // the accumulators hold query rows 2tig and 2tig+1: their factors live in lanes 8tig, 8tig+4
      const float a0 = __shfl_sync(0xffffffffu, a, 8 * tig);
      const float a1 = __shfl_sync(0xffffffffu, a, 8 * tig + 4);
      if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          o[mt][0] *= a0;
          o[mt][1] *= a1;
          o[mt][2] *= a0;
          o[mt][3] *= a1;
        }
      }
    }
    // PAIRV's reads (a full tile at D 128, both P V paths): lanes gid and gid ^ 1 read the same
    // tokens' rows in the same block, codes 0-15 (words 0 and 1) and 16-31 (word 2 and the codes
    // 24-31 gathered from the three words' top bits: iq_top8). Instead of every lane gathering
    // the top codes of all 8 of its tokens (half of them for nothing), each lane gathers 4 (tokens
    // 16 * (odd ? 0 : 1) + 2tig + (0, 1, 8, 9)[j]: the odd lane's first 16 tokens, the even one's
    // second, which are its odd partner's), and one shuffle hands them over (vrecv).
    // VIL: the lane's words of the tile's chunk g (a chunk past a partial tile's rows: chunk 0's,
    // masked)
    auto vil_words = [&](int g, uint32_t* w) {
      const int cg = FULL ? g : (16 * g < nv ? g : 0);
      iq_vil_words<D>(vc_ + 16 * cg * vs_, gid, tig, w);
    };
    const bool vodd = (gid & 1) != 0;
    // token j < 4 of P V k-step (PV8: k-half) g: 16g + 2tig + (0, 1, 8, 9)[j], this lane's columns
    auto vtok = [&](int g, int j) { return 16 * g + 2 * tig + (j & 1) + 8 * (j >> 1); };
    auto pair_tops = [&](auto* vtop, auto* vrecv) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t w[3];
        iq_tc_block<FULL>(vc_ + vtok(vodd ? 0 : 1, j) * vs_ + 12 * (gid >> 1), w);
        vtop[j] = iq_top8(w[0], w[1], w[2]);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) vrecv[j] = __shfl_xor_sync(0xffffffffu, vtop[j], 4);
    };
    // token t's two nibble words: word 0 (even lane) or 2 (odd), raw; word 1 (even) or the
    // gathered top codes `top` (odd)
    auto pair_words = [&](int t, uint32_t top, auto* S) {
      const auto row = vc_ + t * vs_ + 12 * (gid >> 1);
      S[0] = iq_tc_word<FULL>(row + (vodd ? 8 : 0));
      const uint32_t w1 = iq_tc_word<FULL>(row + 4);
      S[1] = vodd ? top : w1;
    };
    if constexpr (PV8) {
      // B fragments: k = 4tig + j (b0) and 16 + 4tig + j (b1) are tokens 2tig + (0, 1, 8, 9)[j]
      // (+ 16): this lane's own columns of Q K^T, so P' needs no exchange; n = gid: part 1 of
      // query row gid (gid < 4) or part 2 of row gid - 4
      uint32_t y[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const __half2 w = *reinterpret_cast<const __half2*>(&nvs[nt]);
        y[nt][0] = iq_pv8_quant(c[nt][0], __low2float(w), poff);
        y[nt][1] = iq_pv8_quant(c[nt][1], __high2float(w), poff);
      }
      const uint32_t pb0 = iq_pv8_pack(y[0][0], y[0][1], y[1][0], y[1][1], psel);
      const uint32_t pb1 = iq_pv8_pack(y[2][0], y[2][1], y[3][0], y[3][1], psel);
      // the selectors of k-step g's A registers (ws[g][q][j]: m-tile 4q + j, rows gid and gid + 8
      // in the low and high 16 bits)
      uint32_t ws[2][NVS][4];
      if constexpr (VIL) {
        // the tc16 layout: chunk g's words are the selectors of k-step g as they are (4 tokens
        // at each coordinate), but for the nibbles' top bits and the top codes (iq_top8)
#pragma unroll
        for (int g = 0; g < 2; ++g) {
          uint32_t w[3 * NVS];
          vil_words(g, w);
#pragma unroll
          for (int q = 0; q < NVS; ++q) {
            ws[g][q][0] = w[3 * q] & 0x77777777u;
            ws[g][q][1] = w[3 * q + 1] & 0x77777777u;
            ws[g][q][2] = w[3 * q + 2] & 0x77777777u;
            ws[g][q][3] = iq_top8(w[3 * q], w[3 * q + 1], w[3 * q + 2]);
          }
        }
      } else {
        // V codes of the 8 tokens (group g = 0: b0's, 1: b1's), D/64 nibble words each
        uint32_t vw[2][4][NVS];
        if constexpr (FULL && D == 128) {  // PAIRV's reads: group g is the odd lane's k-step g
          uint32_t vtop[4], vrecv[4];
          pair_tops(vtop, vrecv);
#pragma unroll
          for (int g = 0; g < 2; ++g) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              pair_words(vtok(g, j), g == 0 ? vtop[j] : vrecv[j], vw[g][j]);
            }
          }
        } else {
#pragma unroll
          for (int g = 0; g < 2; ++g) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              iq_tc_vcodes<D, FULL, decltype(vc_), true>(vc_ + tok(vtok(g, j)) * vs_, gid, vw[g][j]);
            }
          }
        }
#pragma unroll
        for (int q = 0; q < NVS; ++q) {
          iq_pv8_sel(vw[0][0][q], vw[0][1][q], vw[0][2][q], vw[0][3][q], ws[0][q]);
          iq_pv8_sel(vw[1][0][q], vw[1][1][q], vw[1][2][q], vw[1][3][q], ws[1][q]);
        }
      }
      // the accumulators' shift: a larger maximum (k0, k1 for this lane's two columns) or nu's
      // growth (gj)
      if (__any_sync(0xffffffffu, (k0 | k1 | gj) != 0)) {
        const int s0 = min(k0 + gj, 31), s1 = min(k1 + gj, 31);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {  // (rounding toward -inf: < 1 unit of 1 / 256 kappa)
          oi[mt][0] >>= s0;
          oi[mt][1] >>= s1;
          oi[mt][2] >>= s0;
          oi[mt][3] >>= s1;
        }
      }
#pragma unroll
      for (int q = 0; q < NVS; ++q) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t a0_ = iq_prmt(vtab[0], vtab[1], ws[0][q][j]);
          const uint32_t a1_ = iq_prmt(vtab[0], vtab[1], iq_hi16(ws[0][q][j], nz));
          const uint32_t a2_ = iq_prmt(vtab[0], vtab[1], ws[1][q][j]);
          const uint32_t a3_ = iq_prmt(vtab[0], vtab[1], iq_hi16(ws[1][q][j], nz));
          iq_imma(oi[4 * q + j], a0_, a1_, a2_, a3_, pb0, pb1);
        }
      }
    } else {
      constexpr bool PAIRV = FULL && D == 128 && VSN && !VIL;
      uint32_t vtop[PAIRV ? 4 : 1], vrecv[PAIRV ? 4 : 1];
      if constexpr (PAIRV) pair_tops(vtop, vrecv);
#pragma unroll
      for (int h = 0; h < IQ_TILE / 16; ++h) {
        // B fragment of P'^T for tokens 16h + (2tig, 2tig+1 | 2tig+8, 2tig+9); n = query row gid
        uint32_t pb0, pb1, pl0, pl1;
        const __half2 w0 = *reinterpret_cast<const __half2*>(&nvs[2 * h]);
        const __half2 w1 = *reinterpret_cast<const __half2*>(&nvs[2 * h + 1]);
        const float x0 = c[2 * h][0] * __low2float(w0), y0 = c[2 * h][1] * __high2float(w0);
        const float x1 = c[2 * h + 1][0] * __low2float(w1), y1 = c[2 * h + 1][1] * __high2float(w1);
        iq_split_h2(x0, y0, pb0, pl0);
        iq_split_h2(x1, y1, pb1, pl1);
        if (VSN) ps += (x0 + y0) + (x1 + y1);
        // V codes of those four tokens over the lane's D/8 coordinates
        const int t0_ = vtok(h, 0);  // and vtok(h, 1 .. 3): t0_ + 1, 8, 9
        uint32_t va[NVS], vb[NVS], vcc[NVS], vd[NVS];
        uint32_t vw[VIL ? 3 * NVS : 1];  // VIL: the lane's words of chunk h
        if constexpr (VIL) {
          vil_words(h, vw);
        } else if constexpr (PAIRV) {
          const uint32_t* top = h == 0 ? vtop : vrecv;
          pair_words(t0_, top[0], va);
          pair_words(t0_ + 1, top[1], vb);
          pair_words(t0_ + 8, top[2], vcc);
          pair_words(t0_ + 9, top[3], vd);
        } else {
          iq_tc_vcodes<D, FULL, decltype(vc_), VSN>(vc_ + tok(t0_) * vs_, gid, va);
          iq_tc_vcodes<D, FULL, decltype(vc_), VSN>(vc_ + tok(t0_ + 1) * vs_, gid, vb);
          iq_tc_vcodes<D, FULL, decltype(vc_), VSN>(vc_ + tok(t0_ + 8) * vs_, gid, vcc);
          iq_tc_vcodes<D, FULL, decltype(vc_), VSN>(vc_ + tok(t0_ + 9) * vs_, gid, vd);
        }
#pragma unroll
        for (int q = 0; q < NVS; ++q) {
          // selectors of the 4 m-tiles: tokens (2tig, 2tig+1) and (2tig+8, 2tig+9)
          uint32_t sab[4], scd[4];
          if constexpr (VIL) {
            const uint32_t* w = vw + 3 * q;
            iq_vil_vsn(w[0], c80, sab[0], scd[0]);
            iq_vil_vsn(w[1], c80, sab[1], scd[1]);
            iq_vil_vsn(w[2], c80, sab[2], scd[2]);
            iq_vil_vsn(iq_top8(w[0], w[1], w[2]), c80, sab[3], scd[3]);
          } else if constexpr (VSN) {
            iq_vsn_sel(va[q], vb[q], c80, sab);
            iq_vsn_sel(vcc[q], vd[q], c80, scd);
          } else {
            iq_tc_pair(va[q], vb[q], sab);
            iq_tc_pair(vcc[q], vd[q], scd);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t a0_, a1_, a2_, a3_;
            iq_tc_vregs<VSN>(sab[j], vtab, nz, a0_, a1_);
            iq_tc_vregs<VSN>(scd[j], vtab, nz, a2_, a3_);
            iq_mma(o[4 * q + j], a0_, a1_, a2_, a3_, pb0, pb1);
            if (PLO) iq_mma(o[4 * q + j], a0_, a1_, a2_, a3_, pl0, pl1);
          }
        }
      }
    }
  };

  if (!streams) {
    for (int tile = t0; tile < t1; tile += IQ_TILE) {
      step(IqBool<false>(), kc + tile * ks, ks, kn + tile * kns, kns, vc + tile * vs, vs,
           vn + tile * vns, vns, min(IQ_TILE, t1 - tile));
    }
  } else {
    const int ntiles = (t1 - t0 + IQ_TILE - 1) / IQ_TILE;
    const uint32_t sstage = iq_smem(stage);
    if (!prefetched) stream.prologue();
    for (int i = 0; i < ntiles; ++i) {
      if (stream.left > 0) stream.issue();
      iq_cp_commit();
      iq_cp_wait_all_but<IQ_STAGES - 1>();
      __syncwarp();
      const IqSmem<uint8_t> st{sstage + (unsigned(i) % IQ_STAGES) * SB};
      const IqSmem<__half> kn_{st.a + 2 * TK};
      const IqSmem<__half> vn_{st.a + 2 * TK + 2 * IQ_TILE};
      const int nv = t1 - (t0 + IQ_TILE * i);
      if (nv >= IQ_TILE) {
        step(IqBool<true>(), st, KROW, kn_, 1, st + TK, KROW, vn_, 1, IQ_TILE);
      } else {
        step(IqBool<false>(), st, KROW, kn_, 1, st + TK, KROW, vn_, 1, nv);
      }
      __syncwarp();  // every lane is done with this stage before it is refilled
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (VSN) {  // accumulators in level units: 2^24 acc - 128 sum P' of their query row
    ps += __shfl_xor_sync(0xffffffffu, ps, 1);
    ps += __shfl_xor_sync(0xffffffffu, ps, 2);
    const float s0 = 128.0f * __shfl_sync(0xffffffffu, ps, 8 * tig);
    const float s1 = 128.0f * __shfl_sync(0xffffffffu, ps, 8 * tig + 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      o[mt][0] = fmaf(o[mt][0], 16777216.0f, -s0);
      o[mt][1] = fmaf(o[mt][1], 16777216.0f, -s1);
      o[mt][2] = fmaf(o[mt][2], 16777216.0f, -s0);
      o[mt][3] = fmaf(o[mt][3], 16777216.0f, -s1);
    }
  }
  // The partial's place and its scale, from the parameters and the block index again rather than
  // kept from the set-up: values live through the tile loop take its registers (H200, side by
  // side: B8 T8K 23.57 -> 23.15 us, B8 T32K 66.2 -> 65.5, B1 T2K 9.02 -> 8.86; docs/kernels.md).
  const int R = ip[IQ_P_R];
  int pbx, pby, pbh;
  iq_tc_place(R, pbx, pby, pbh);
  const int r0 = pby * 8;
  const long prow = (long(pbh) * ip[IQ_P_NSP] + pbx) * R;
  const float vsc = rsqrtf(float(D)) * fp[4];
  // PV8: 1 / kappa, for the accumulators (part 2's columns also / 256) and the sums (/ 256)
  const float ik = PV8 ? iq_ex2(8.0f - lk8) : 1.0f;
  if (PV8) l *= ik * (1.0f / 256.0f);
  // The threadgroup's IQ_NW warps merge into one partial (rows r0 .. r0+7 at prow + r): the
  // warps' maxima and sums ([IQ_NW][8] each, an array of their own), then red = [IQ_NW][8]
  // rows of rescaled accumulators (IQ_MROW<D> floats each; red overlays the warps' stages, so
  // every warp must be done streaming before it is written: the barrier that publishes the
  // maxima also waits for that, one barrier where the merge had two before it).
  __shared__ float iq_rml[2 * IQ_NW * 8];
  const int warp = threadIdx.x / 32;
  float* rm = iq_rml;
  float* rl = iq_rml + IQ_NW * 8;
  float* ro = red;
  if (tig == 0) {
    rm[warp * 8 + gid] = m;
    rl[warp * 8 + gid] = l;
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * tig + e;  // this lane's accumulator row
    float mmax = NEG_INF;
#pragma unroll
    for (int w = 0; w < IQ_NW; ++w) mmax = fmaxf(mmax, rm[w * 8 + r]);
    const float mine = rm[warp * 8 + r];
    float f = mine == NEG_INF ? 0.0f : iq_ex2(mine - mmax) * vsc;
    if (PV8) f *= tig >= 2 ? ik * (1.0f / 256.0f) : ik;  // PV8: r is a column (rows 4-7: part 2)
    float* out =
        ro + (warp * 8 + r) * IQ_MROW<D> + gid * (D / 8) + iq_tc_moff<D>(gid * (D / 8), r);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float v0 = PV8 ? float(oi[mt][e]) : o[PV8 ? 0 : mt][e];
      const float v1 = PV8 ? float(oi[mt][2 + e]) : o[PV8 ? 0 : mt][2 + e];
      out[VIL ? iq_tc_vcode_vil(mt, 0) : iq_tc_vcode(mt, 0)] = v0 * f;
      out[VIL ? iq_tc_vcode_vil(mt, 1) : iq_tc_vcode(mt, 1)] = v1 * f;
    }
  }
  __syncthreads();
  const int nrow = min(8, R - r0);
  for (int i = threadIdx.x; i < nrow * D; i += IQ_NW * 32) {
    const int r = i / D, d = i % D;
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < IQ_NW; ++w) acc += ro[(w * 8 + r) * IQ_MROW<D> + d + iq_tc_moff<D>(d, r)];
    if (PV8) {  // + part 2 (rows <= 4)
#pragma unroll
      for (int w = 0; w < IQ_NW; ++w) {
        acc += ro[(w * 8 + r + 4) * IQ_MROW<D> + d + iq_tc_moff<D>(d, r + 4)];
      }
    }
    po[(prow + r0) * D + i] = acc;
  }
  if (threadIdx.x < nrow) {
    const int r = threadIdx.x;
    float mmax = NEG_INF;
#pragma unroll
    for (int w = 0; w < IQ_NW; ++w) mmax = fmaxf(mmax, rm[w * 8 + r]);
    float lsum = 0.0f;
#pragma unroll
    for (int w = 0; w < IQ_NW; ++w) {
      const float mw = rm[w * 8 + r];
      lsum += mw == NEG_INF ? 0.0f : iq_ex2(mw - mmax) * rl[w * 8 + r];
    }
    pm[prow + r0 + r] = mmax;
    pl[prow + r0 + r] = lsum;
  }
}

// The combine, folded into the split kernel: the threadgroup that finishes last for (bh, row
// block) (a ticket from `ctr`, reset to 0 for the next call) merges all NSP partials of rows
// r0 .. r0+7 (< R): warp w takes rows w, w + IQ_NW, ...; its lanes walk the splits together,
// D/32 coordinates each; then R^T once per row (compressed part), the float part added, / the
// total weight (sink included). KIND 0/1 with D <= 128: each warp rotates and writes its own rows
// (iq_inverse_rotate_row_warp on the head's blocks staged in srot: no barrier, no global loads
// of the blocks); else the threadgroup rotation (iq_rotate_rows) after a barrier. x, xf: [8][D]
// threadgroup scratch; tot: [8].
template <int D, int KIND, typename TO, typename PR, typename PS>
__device__ __forceinline__ void iq_tc_fold(
    const float* po, const float* pm, const float* pl, PR rot, const float* srot, PS sinks, TO* out,
    int* counters, float* x, float* xf, float* tot, const int* ip, const float* fp) {
  constexpr bool WARP_ROT = KIND != 2 && D <= 128;
  __shared__ int iq_last;
  const int tid = threadIdx.x;
  // the parameters the merge reads, loaded before the ticket (not one more round trip after it)
  const int R = ip[IQ_P_R], L = ip[IQ_P_L], G = ip[IQ_P_G], Hkv = ip[IQ_P_HKV];
  const int nsp = ip[IQ_P_NSP], nspc = ip[IQ_P_NSPC];
  const int has_sinks = ip[IQ_P_SINKS];
  const float log2e = fp[2];
  // the threadgroup's place again (not kept live through the tile loop, where one or two more
  // registers changed how ptxas scheduled the loop against the build without the fold)
  int bx, by, bh;
  iq_tc_place(R, bx, by, bh);
  const int r0 = by * 8;
  int* ctr = counters + int(blockIdx.x);  // one slot per row block
  __syncthreads();  // every warp of this threadgroup has written its partial
  if (tid == 0) {
    __threadfence();
    const int ticket = atomicAdd(ctr, 1);
    iq_last = ticket == int(gridDim.y) - 1;
  }
  __syncthreads();
  if (!iq_last) return;
  __threadfence();  // the other threadgroups' partials are visible (read past L1: __ldcg)
  constexpr int V = D / 32;
  const float NEG_INF = __int_as_float(0xff800000);
  const int nrow = min(8, R - r0);
  const int warp = tid / 32, lane = tid % 32;
  // where row r of the block goes in out ([B, Hq, L, D]): query head h G + row / L of sequence
  // b, with bh = b Hkv + h and Hq = Hkv G, so b Hq + h G = bh G (no division by Hkv; none by L
  // for decode's L = 1: the fold is on the call's last threadgroups' path)
  auto out_row = [&](int r) {
    const int row = r0 + r;
    const int qh = L == 1 ? row : row / L, qt = L == 1 ? 0 : row % L;
    return ((long(bh) * G + qh) * L + qt) * D;
  };
  // Warp w merges rows w, w + IQ_NW, ... (decode's 4 query rows: one each), CH splits at a time
  // with every load of a chunk in flight at once: the loads do not wait for the maximum (a running
  // maximum rescales the sums per chunk). One L2 round trip per 8 splits, where the maximum, then 4
  // splits at a time took 3 at B8 (8 splits) and 9 at B1 (32).
  constexpr int CH = 8;
  for (int r = warp; r < nrow; r += IQ_NW) {
    const long base = long(bh) * nsp * R + r0 + r;
    // the sink's logit starts the running maximum with weight 1
    float M = NEG_INF;
    if (has_sinks != 0) {
      M = float(sinks[(bh % Hkv) * G + (L == 1 ? r0 + r : (r0 + r) / L)]) * log2e;
    }
    float t = M == NEG_INF ? 0.0f : 1.0f;
    float oc[V], of[V];
#pragma unroll
    for (int i = 0; i < V; ++i) oc[i] = of[i] = 0.0f;
    for (int s0 = 0; s0 < nsp; s0 += CH) {
      float vm[CH], vl[CH], vo[CH][V];
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const bool in = s0 + c < nsp;
        const long row = base + long(in ? s0 + c : 0) * R;
        vm[c] = in ? __ldcg(pm + row) : NEG_INF;
        vl[c] = __ldcg(pl + row);
#pragma unroll
        for (int i = 0; i < V; ++i) vo[c][i] = __ldcg(po + row * D + lane + 32 * i);
      }
      float n = M;
#pragma unroll
      for (int c = 0; c < CH; ++c) n = fmaxf(n, vm[c]);
      const float mb = n == NEG_INF ? 0.0f : n;
      const float sc = iq_ex2(M - mb);
      M = n;
      t *= sc;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        oc[i] *= sc;
        of[i] *= sc;
      }
      // Two copies of the chunk's sum, as measured: one loop with the float part
      // switched off per chunk compiles to other SASS (nvcc 13), not timed.
      if (s0 + CH <= nspc) {  // compressed splits only (they come first): no float part
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          const float w = iq_ex2(vm[c] - mb);
          t += w * vl[c];
#pragma unroll
          for (int i = 0; i < V; ++i) oc[i] += w * vo[c][i];
        }
      } else {
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          const float w = iq_ex2(vm[c] - mb);  // 0 past nsp
          const float wc = s0 + c < nspc ? w : 0.0f;  // compressed splits first, then float ones
          t += w * vl[c];
#pragma unroll
          for (int i = 0; i < V; ++i) {
            oc[i] += wc * vo[c][i];
            of[i] += (w - wc) * vo[c][i];
          }
        }
      }
    }
    if constexpr (WARP_ROT) {
#pragma unroll
      for (int i = 0; i < V; ++i) x[r * D + lane + 32 * i] = oc[i];
      __syncwarp();
      iq_inverse_rotate_row_warp<D, KIND>(x + r * D, srot, 0, lane);
      __syncwarp();
      const float inv = t > 0.0f ? 1.0f / t : 0.0f;
      const long ob = out_row(r);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        out[ob + lane + 32 * i] = static_cast<TO>((x[r * D + lane + 32 * i] + of[i]) * inv);
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        x[r * D + lane + 32 * i] = oc[i];
        xf[r * D + lane + 32 * i] = of[i];
      }
      if (lane == 0) tot[r] = t;
    }
  }
  if constexpr (!WARP_ROT) {
    __syncthreads();
    // (ends with a barrier)
    iq_rotate_rows<D, 8, KIND, IQ_NW * 32>(x, xf + 8 * D, rot, bh % Hkv, true, tid);
    for (int i = tid; i < nrow * D; i += IQ_NW * 32) {
      const int r = i / D;
      const float inv = tot[r] > 0.0f ? 1.0f / tot[r] : 0.0f;
      out[out_row(r) + i % D] = static_cast<TO>((x[i] + xf[i]) * inv);
    }
  }
  if (tid == 0) *ctr = 0;  // ready for the next call that draws this slot
}
// @end

// @kernel iq_fused_tc
// The inputs of iq_fused_scalar with RB = 8 rows per threadgroup, plus sinks and
// counters (B*Hkv*row blocks int32 zeros, a fresh slot range per call: iq_tc_fold); grid: row
// blocks x splits (iq_tc_place; the scalar kernel's is splits x row blocks x B*Hkv); partials:
// one per threadgroup for compressed tokens (its warps merged: NSPC = NCB), one per warp for
// float ones; out: the attention output, written by the last threadgroup of each row block
// (FOLD; without it, out is left unwritten and iq_combine merges the partials).
// template: D, KIND, CAUSAL, QLO, PLO, QS, TO, FOLD, PF, KI8, VSN (codes are 3-bit; QLO adds the
// fp16 rounding remainder of the query in the A rows 8-15 at no extra tensor work, PLO that of P'
// as a second mma; PF issues the first tiles' loads before the query set-up; KI8 computes Q K^T on
// the int8 tensor cores: the K table must hold integers in [-127, 127], QLO and QS are then moot;
// VSN takes the V levels as fp16 subnormals: the V table must hold integers in [-127, 127], the
// four lowest negative; PV8 computes P V on the int8 tensor cores: with KI8 and KIND 0/1, at
// most 4 rows per (batch, KV head) and fewer than 2^17 tokens per warp (int32 accumulators),
// the V table holding the int8 levels; VSN is then moot; VIL: v_codes in packing.py's tc16
// layout, contiguous rows, with PV8 or VSN).
// Float splits use the scalar warp walk.
{
  constexpr int RB = 8;
  static_assert(!PV8 || (KI8 && KIND != 2), "PV8 takes the int8 fragments of the warp rotation");
  constexpr int KB = 3;
  constexpr int VB = 3;
  // one buffer, three uses in turn: rotation scratch, then either the warps' cp.async stages
  // (packed splits) or their probability tiles (float splits)
  constexpr int SCRATCH = RB * D * 4;
  constexpr int STAGES = IQ_NW * IQ_STAGES * IqStage<D>::BYTES;
  constexpr int PW = IQ_NW * RB * 32 * 4;
  constexpr int RED = IQ_NW * RB * IQ_MROW<D> * 4;  // the warps' merge (iq_tc_warp's end)
  constexpr int BUF0 = STAGES > SCRATCH ? (STAGES > PW ? STAGES : PW) : (SCRATCH > PW ? SCRATCH : PW);
  constexpr int BUF = BUF0 > RED ? BUF0 : RED;
  __shared__ __align__(16) float iq_qs[RB * D];
  __shared__ __align__(16) uint8_t iq_buf[BUF];
  __shared__ uint32_t iq_tab[16];  // the K and V level tables (iparams[IQ_P_TAB ..]), twice
  // QS: the warps' shared Q fragments ([D/16][32]; KI8: [D/32][32] int8 ones)
  __shared__ uint4 iq_qf[QS || KI8 ? (D / 16) * 32 : 1];
  __shared__ float iq_qm[RB];  // KI8: the query rows' scales
  float* iq_tmp = reinterpret_cast<float*>(iq_buf);
  float* iq_pw = reinterpret_cast<float*>(iq_buf);
  const int Tf = iparams[IQ_P_TF];
  const int L = iparams[IQ_P_L];
  const int R = iparams[IQ_P_R];
  const int G = iparams[IQ_P_G];
  const int NCB = iparams[IQ_P_NCB];
  const int Hkv = iparams[IQ_P_HKV];
  const int nsp = iparams[IQ_P_NSP];
  // The float parameters with the integer ones, at the head of the set-up's chain of loads: read
  // where they are used (after the first barrier), the query scale's load waited behind the
  // threadgroups' first tiles in flight (H200, B8 T32K: ~1.6% of the kernel's warp samples).
  const float fp_q = fparams[1], fp_kinv = fparams[3];
  int bx, by, bz;  // this threadgroup's role
  iq_tc_place(R, bx, by, bz);
  const int bh = bz;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const bool is_fp = bx >= NCB;
  const int r0 = by * RB;
  const int warp = iq_tid / 32;
  const int lane = iq_tid % 32;
  // float splits: this warp's tokens, one per lane as the walk reads them
  const int spf = (bx - NCB) * IQ_NW + warp;
  const int tf0 = spf * iparams[IQ_P_SLF];
  const int tf1 = min(tf0 + iparams[IQ_P_SLF], Tf);
  const long flo = long(iparams[IQ_P_FLO]);  // the window's first row in a cache's buffer
  const auto* kf = k_fp + b * k_fp_strides[0] + h * k_fp_strides[1] + flo * k_fp_strides[2];
  const auto* vf = v_fp + b * v_fp_strides[0] + h * v_fp_strides[1] + flo * v_fp_strides[2];
  const long kfs = long(k_fp_strides[2]), vfs = long(v_fp_strides[2]);
  if (is_fp && tf0 + lane < tf1) {  // their K and V rows into L1 while the query rows load
    iq_prefetch_row<D>(kf + (tf0 + lane) * kfs);
    iq_prefetch_row<D>(vf + (tf0 + lane) * vfs);
  }
  const long qst[4] = {long(q_strides[0]), long(q_strides[1]), long(q_strides[2]), long(q_strides[3])};
  // The set-up's global loads are all issued before the first of them is used (one round trip,
  // where the compiler kept each load next to its store: query rows, then the blocks, then the
  // split's bounds and the levels, each waiting for the one before): this warp's compressed
  // split (its end reads the sequence length), the level tables, and KIND 0/1: head h's SO(4)
  // blocks ([D/4][4][4], staged in shared memory alongside the query: one coalesced round trip
  // instead of 16 strided loads per block after the WHT) into registers, then the query rows,
  // then the stores.
  const int t0 = (bx * IQ_NW + warp) * iparams[IQ_P_SL];
  const int t1 = min(t0 + iparams[IQ_P_SL], min(iparams[IQ_P_TC], int(lens[b])));
  uint32_t tab_ = 0u;
  if (iq_tid < 16) tab_ = uint32_t(iparams[IQ_P_TAB + (iq_tid & 7)]);
  static_assert((D * 4) % IQ_NT == 0, "whole rounds of the threadgroup over the blocks");
  constexpr int NROT = KIND == 2 ? 1 : D * 4 / IQ_NT;
  __shared__ float iq_rot[KIND == 2 ? 1 : D * 4];
  // (FOLD: every threadgroup, since the last one, which merges, may be a float one)
  const bool stage_rot = KIND != 2 && (!is_fp || FOLD);
  float rotv[NROT];
  if (stage_rot) {
    for (int j = 0; j < NROT; ++j) rotv[j] = float(rot[long(h) * D * 4 + iq_tid + j * IQ_NT]);
  }
  iq_tc_load_q_rows<D, RB, IQ_NT>(iq_qs, q, qst, b, h, r0, R, G, L, iq_tid);
  if (stage_rot) {
    for (int j = 0; j < NROT; ++j) iq_rot[iq_tid + j * IQ_NT] = rotv[j];
  }
  if (iq_tid < 16) iq_tab[iq_tid] = tab_;
  // This warp's head's code and norm rows.
  const uint8_t* kc = k_codes + b * k_codes_strides[0] + h * k_codes_strides[1];
  const __half* kn = k_norms + b * k_norms_strides[0] + h * k_norms_strides[1];
  const uint8_t* vc = v_codes + b * v_codes_strides[0] + h * v_codes_strides[1];
  const __half* vn = v_norms + b * v_norms_strides[0] + h * v_norms_strides[1];
  const long ks = long(k_codes_strides[2]), kns = long(k_norms_strides[2]);
  const long vs = long(v_codes_strides[2]), vns = long(v_norms_strides[2]);
  uint8_t* stage = iq_buf + warp * IQ_STAGES * IqStage<D>::BYTES;
  // PF: the first tiles' loads are issued before the query is loaded and rotated, so their DRAM
  // latency overlaps that set-up (the dense rotation's scratch overlays the stages: not with
  // KIND 2). Measured within noise on the H200 (attention_decode.json: prefetch_off column).
  const bool streams =
      !is_fp && t0 < t1 && iq_tc_streams<D>(stage, kc, ks, kn, kns, vc, vs, vn, vns, t0);
  IqStream<D, VIL> stream(stage, kc, kn, vc, vn, t0, t1, lane);
  const bool pre = PF && KIND != 2 && streams;
  if (pre) stream.prologue();
  __syncthreads();
  const float qscale = fp_q * (is_fp ? 1.0f : rsqrtf(float(D)));
  if (KIND != 2 && !is_fp) {
    iq_rotate_rows_warp<D, RB, KIND, PV8>(iq_qs, iq_rot, qscale, warp, lane, KI8 ? iq_qm : nullptr,
                                     KI8 ? iq_qf : nullptr, R - r0);
  } else {
    if (KIND == 2 && !is_fp) iq_rotate_rows<D, RB, KIND, IQ_NT>(iq_qs, iq_tmp, rot, h, false, iq_tid);
    for (int i = iq_tid; i < RB * D; i += IQ_NT) {
      iq_qs[i] *= qscale;
    }
  }
  __syncthreads();
  if (KI8 && KIND == 2 && !is_fp) {  // (KIND 0/1: the warp rotation wrote the fragments)
    for (int r = warp; r < RB; r += IQ_NW) {  // the rows' scales
      float m = 0.0f;
      for (int d = lane; d < D; d += 32) m = fmaxf(m, fabsf(iq_qs[r * D + d]));
      m = iq_warp_max(m);
      if (lane == 0) iq_qm[r] = iq_i8_row_scale(m);
    }
    __syncthreads();
    for (int i = iq_tid; i < (D / 32) * 32; i += IQ_NT) {
      iq_qf[i] = iq_tc_qfrag_i8<D>(iq_qs, iq_qm, i / 32, (i % 32) >> 2, i & 3);
    }
    __syncthreads();
  } else if (!KI8 && QS && !is_fp) {
    for (int i = iq_tid; i < (D / 16) * 32; i += IQ_NT) {
      iq_qf[i] = iq_tc_qfrag<D, QLO>(iq_qs, i / 32, (i % 32) >> 2, i & 3);
    }
    __syncthreads();
  }
  if (!is_fp) {
    iq_tc_warp<D, QLO, PLO, QS, KI8, VSN && !PV8, PV8, VIL>(
        iq_qs, iq_qf, iq_qm, iq_tab, kc, ks, kn, kns, vc, vs, vn, vns, t0, t1, lane, fp_kinv,
        fparams, stage, reinterpret_cast<float*>(iq_buf), part_o, part_m, part_l, iparams, stream,
        streams, pre);
  } else {
    float m[RB];
    float l[RB];
    float o[RB * (D / 32)];
    float* pw = iq_pw + warp * RB * 32;
    if (iq_float_vec(kf, kfs, vf, vfs)) {
      iq_warp_attend<D, RB, KB, VB, CAUSAL>(IqFloatVec(), iq_qs, nullptr, nullptr, pw, kf, kfs,
                                            k_norms, 0L, vf, vfs, v_norms, 0L, tf0, tf1, r0, L,
                                            Tf, lane, m, l, o);
    } else {
      iq_warp_attend<D, RB, KB, VB, CAUSAL>(IqFloat(), iq_qs, nullptr, nullptr, pw, kf, kfs, k_norms,
                                            0L, vf, vfs, v_norms, 0L, tf0, tf1, r0, L, Tf, lane,
                                            m, l, o);
    }
    iq_store_partial<D, RB>(part_o, part_m, part_l, bh, iparams[IQ_P_NSPC] + spf, nsp, r0, R,
                            lane, m, l, o);
  }
  // threadgroup scratch for the fold: iq_qs (the query rows are no longer needed) and iq_buf
  float* iq_fx = reinterpret_cast<float*>(iq_buf);
  if (FOLD) {
    iq_tc_fold<D, KIND, TO>(part_o, part_m, part_l, rot, iq_rot, sinks, out,
                            const_cast<int*>(counters), iq_qs, iq_fx, iq_fx + 16 * D, iparams,
                            fparams);
  }
}
// @end

// @kernel iq_tc16_pack
// The cache's decode-time write of V codes in the tc16 layout (packing.py), whole chunks at once:
// rows [c0 + off, c0 + off + N) from vc (rows, as the encoder writes them), rows [c0, c0 + off)
// from old (the tc16 chunk at c0 the cache holds; off < 16), rows after the new ones code 0.
// chunks: the NC chunks from c0 on; one 32-bit word a thread (~40 MLX ops a layer in one launch).
// iparams: Hkv, N, off, NC; grid (words of NC chunks rounded up to 64, 1, B*Hkv), group 64;
// template: D.
{
  constexpr int RB = 3 * D / 8;  // bytes of a row
  constexpr int NBL = D / 64;    // blocks of 32 codes per lane-block
  constexpr int WPC = 6 * D / 4;  // words of a chunk
  const int Hkv = iparams[0], N = iparams[1], off = iparams[2], NC = iparams[3];
  const int bh = iq_bz;
  const int b = bh / Hkv, h = bh % Hkv;
  const int w = iq_bx * 64 + iq_tid;
  if (w >= NC * WPC) return;
  const int ch = w / WPC, wc = w % WPC;
  const int blk = wc / 3, j = wc % 3;
  const int bb = blk % NBL, i = (blk / NBL) % 4, lb = blk / (4 * NBL);
  const uint8_t* vrow = vc + b * vc_strides[0] + h * vc_strides[1];
  const uint8_t* ochunk = old + b * old_strides[0] + h * old_strides[1];
  const long vs = long(vc_strides[2]), os = long(old_strides[2]);
  // code of chunk row p (of chunk ch) at coordinate d
  auto code = [&](int p, int d) -> uint32_t {
    const int q = ch * 16 + p;
    if (q < off) {  // the old chunk, tc16: token p's slot s in group gi, block (lb, gi, bb)
      const int gi = (p & 7) >> 1, s = (p & 1) | ((p >> 3) << 1);
      const int l = d / (D / 8), bo = (d % (D / 8)) / 8;
      const int o = 12 * ((l * 4 + gi) * NBL + bo);  // (a block never straddles rows: RB % 12 == 0)
      return uint32_t(iq_code_at<3>(ochunk + (o / RB) * os + o % RB, 4 * (d % 8) + s));
    }
    if (q - off < N) return uint32_t(iq_code_at<3>(vrow + (q - off) * vs, d));
    return 0u;
  };
  uint32_t word = 0u;
  for (int n = 0; n < 8; ++n) {
    const int s = n & 3;
    const int p = 2 * i + (s & 1) + 8 * (s >> 1);
    const int d0 = lb * (D / 8) + bb * 8;
    const uint32_t lo = code(p, d0 + 2 * j + (n >> 2)) & 7u;
    const uint32_t hi = (code(p, d0 + 6 + (n >> 2)) >> j) & 1u;
    word |= (lo | (hi << 3)) << (4 * n);
  }
  uint8_t* o = chunks + (long(bh) * NC * 16) * RB + 4L * w;
  o[0] = uint8_t(word);
  o[1] = uint8_t(word >> 8);
  o[2] = uint8_t(word >> 16);
  o[3] = uint8_t(word >> 24);
}
// @end
