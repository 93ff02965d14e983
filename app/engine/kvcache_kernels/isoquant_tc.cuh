// IsoQuant split-K attention on NVIDIA tensor cores (CUDA only; its Metal counterpart is the
// scalar kernel iq_fused_scalar in isoquant_body.h, which computes the same partials).
//
// 3-bit codes, D in {64, 128}, up to 16 query rows per KV head. Per warp and 16-token tile:
//   S = Q K^T with mma.m16n8k16 (rows = query rows, k = coordinates, n = tokens): the query is
//     split into fp16 hi + lo parts (two mma) so scores keep ~fp32 precision; K codes become the
//     B fragment directly: 4 codes -> a 4-nibble selector -> 2 byte permutes through the fp16
//     level table (low bytes, high bytes) -> 2 more permutes into two half2 registers.
//   online softmax on the C fragment (log2 domain), P' = p * ‖v‖/sqrt(D) as the A fragment,
//   O += P' V with the V codes of 4 tokens at one coordinate decoded the same way.
// Coordinate maps (a permutation of the dot product, undone when O is stored):
//   QK: lane (gid, tig) holds coordinates [tig*D/4, tig*D/4 + D/4) of its token; k-tile kt
//       uses coordinates tig*D/4 + 4kt + {0,1} (b0) and + {2,3} (b1).
//   PV: n-tile nt, column gid is coordinate gid*D/8 + nt.
// Partials have the layout of iq_fused_scalar (iq_combine merges either).
// The level tables arrive scaled by s (fparams[3] = 1/s for K, [4] for V), s chosen so the fp16
// table rounds the levels ~10x closer than plain fp16 would; the norms carry the 1/s back.
// iq_mma (one m16n8k16 f16 -> f32 multiply-accumulate) comes from the CUDA prologue.

// @header
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

// 4 codes of 3 bits (x = c0 | c1<<3 | c2<<6 | c3<<9) -> byte-permute selector c0 | c1<<4 | ...
__device__ __forceinline__ uint32_t iq_spread4(uint32_t x) {
  const uint32_t t = (x & 0x3Fu) | ((x & 0xFC0u) << 2);  // c2, c3 up by 2
  return (t & 0x707u) | ((t & 0x3838u) << 1);            // c1, c3 up by 1
}

// Levels of 4 codes as two half2 registers: (c0, c1) and (c2, c3).
__device__ __forceinline__ void iq_lut4(uint32_t sel, const uint32_t tab[4], uint32_t& b0, uint32_t& b1) {
  const uint32_t lo = __byte_perm(tab[0], tab[1], sel);
  const uint32_t hi = __byte_perm(tab[2], tab[3], sel);
  b0 = __byte_perm(lo, hi, 0x5140);
  b1 = __byte_perm(lo, hi, 0x7362);
}

// fp16 level table as byte planes: tab[0..1] low bytes of levels 0-7, tab[2..3] high bytes.
__device__ __forceinline__ void iq_level_table(const float* lv, uint32_t tab[4]) {
  tab[0] = tab[1] = tab[2] = tab[3] = 0u;
  for (int c = 0; c < 8; ++c) {
    const uint32_t hbits = __half_as_ushort(__float2half_rn(lv[c]));
    tab[c >> 2] |= (hbits & 0xFFu) << (8 * (c & 3));
    tab[2 + (c >> 2)] |= (hbits >> 8) << (8 * (c & 3));
  }
}

// The lane's 3*D/4 bits of a K row (coordinates [tig*D/4, +D/4)) as 32-bit words.
template <int D>
__device__ __forceinline__ void iq_tc_kbits(const uint8_t* row, int tig, uint32_t w[(3 * D / 4 + 31) / 32]) {
  constexpr int NH = 3 * D / 64;  // 16-bit pieces; rows and lane offsets are 2-byte aligned
  const uint16_t* p = reinterpret_cast<const uint16_t*>(row + tig * (3 * D / 32));
#pragma unroll
  for (int i = 0; i < (3 * D / 4 + 31) / 32; ++i) w[i] = 0u;
#pragma unroll
  for (int i = 0; i < NH; ++i) w[i >> 1] |= uint32_t(p[i]) << (16 * (i & 1));
}

// The lane's 3*D/8 bits of a V row (coordinates [gid*D/8, +D/8)) as one u64.
template <int D>
__device__ __forceinline__ uint64_t iq_tc_vbits(const uint8_t* row, int gid) {
  uint64_t v = 0;
  if (D == 128) {  // 6 bytes at an even offset
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row + 6 * gid);
    v = uint64_t(p[0]) | (uint64_t(p[1]) << 16) | (uint64_t(p[2]) << 32);
  } else {  // D == 64: 3 bytes
    const uint8_t* p = row + 3 * gid;
    v = uint64_t(p[0]) | (uint64_t(p[1]) << 8) | (uint64_t(p[2]) << 16);
  }
  return v;
}

// Bytes of one pipeline stage: the K and V codes of 16 tokens, then their K and V norms.
template <int D>
struct IqStage {
  static constexpr int KROW = 3 * D / 8;     // bytes of a packed row
  static constexpr int TK = 16 * KROW;       // codes of a 16-token tile
  static constexpr int BYTES = 2 * TK + 64;  // + 16 fp16 norms of K and of V
};
#define IQ_STAGES 4  // tiles in flight per warp: hides HBM latency behind the decode and mma

IQ_FN bool iq_aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// One warp over compressed tokens [t0, t1); writes its partial (split sp) itself.
// stage: this warp's IQ_STAGES * IqStage<D>::BYTES of shared memory. Contiguous, aligned rows
// stream through it with cp.async; other layouts (views with odd strides) are read directly.
template <int D, bool R16, bool QLO, bool PLO>
__device__ __forceinline__ void iq_tc_warp(
    const float* qs, const float* lvk, const float* lvv, const uint8_t* kc, long ks,
    const __half* kn, long kns, const uint8_t* vc, long vs, const __half* vn, long vns, int t0,
    int t1, int lane, float kinv, float vinv, uint8_t* stage, float* po, float* pm, float* pl,
    int bh, int sp, int nsp, int r0, int R) {
  constexpr int KT = D / 16;  // k-tiles of QK
  constexpr int NTV = D / 8;  // n-tiles of PV
  constexpr int NKW = (3 * D / 4 + 31) / 32;
  constexpr int KROW = IqStage<D>::KROW;
  constexpr int TK = IqStage<D>::TK;
  constexpr int SB = IqStage<D>::BYTES;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const float NEG_INF = __int_as_float(0xff800000);
  uint32_t ktab[4], vtab[4];
  iq_level_table(lvk, ktab);
  iq_level_table(lvv, vtab);
  // Q fragments, hi and lo fp16 parts; rows gid and gid + 8
  uint32_t qh[KT][4], ql[KT][4];
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    const int c0 = tig * (D / 4) + 4 * kt;
#pragma unroll
    for (int half_ = 0; half_ < 2; ++half_) {
      const int row = gid + 8 * half_;
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = (R16 || half_ == 0) ? qs[row * D + c0 + e] : 0.0f;
      const uint32_t h01 = iq_pack_h2(x[0], x[1]);
      const uint32_t h23 = iq_pack_h2(x[2], x[3]);
      const __half2 a = *reinterpret_cast<const __half2*>(&h01);
      const __half2 c = *reinterpret_cast<const __half2*>(&h23);
      qh[kt][half_] = h01;
      qh[kt][2 + half_] = h23;
      ql[kt][half_] = iq_pack_h2(x[0] - __low2float(a), x[1] - __high2float(a));
      ql[kt][2 + half_] = iq_pack_h2(x[2] - __low2float(c), x[3] - __high2float(c));
    }
  }
  float o[NTV][4];
#pragma unroll
  for (int nt = 0; nt < NTV; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
  const float vsc = rsqrtf(float(D)) * vinv;

  // One 16-token tile: rows of token i at kc_ + i*ks_ etc.; tokens >= nv are masked.
  auto step = [&](const uint8_t* kc_, long ks_, const __half* kn_, long kns_, const uint8_t* vc_,
                  long vs_, const __half* vn_, long vns_, int nv) {
    const int last = nv - 1;
    float s[2][4], s2[2][4];  // hi and lo query parts accumulate apart: two shorter mma chains
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      s2[nt][0] = s2[nt][1] = s2[nt][2] = s2[nt][3] = 0.0f;
      const int j = min(8 * nt + gid, last);
      uint32_t kw[NKW];
      iq_tc_kbits<D>(kc_ + j * ks_, tig, kw);
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        const int bit = 12 * kt;
        const int wi = bit >> 5;
        const int sh = bit & 31;
        uint32_t x = kw[wi] >> sh;
        if (sh > 20) x |= kw[wi + 1] << (32 - sh);
        uint32_t b0, b1;
        iq_lut4(iq_spread4(x & 0xFFFu), ktab, b0, b1);
        iq_mma(s[nt], qh[kt][0], qh[kt][1], qh[kt][2], qh[kt][3], b0, b1);
        if (QLO) iq_mma(s2[nt], ql[kt][0], ql[kt][1], ql[kt][2], ql[kt][3], b0, b1);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] += s2[nt][e];
    }
    // columns of this lane: tokens 8nt + 2tig + e
    float nvs[2][2];
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = 8 * nt + 2 * tig + e;
        const bool ok = tok < nv;
        const int tc = min(tok, last);
        const float nk = __half2float(kn_[tc * kns_]) * kinv;
        nvs[nt][e] = ok ? __half2float(vn_[tc * vns_]) * vsc : 0.0f;
        s[nt][e] = ok ? s[nt][e] * nk : NEG_INF;
        s[nt][2 + e] = ok ? s[nt][2 + e] * nk : NEG_INF;
        mx0 = fmaxf(mx0, s[nt][e]);
        mx1 = fmaxf(mx1, s[nt][2 + e]);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float b0s = n0 == NEG_INF ? 0.0f : n0;
    const float b1s = n1 == NEG_INF ? 0.0f : n1;
    const float a0 = exp2f(m0 - b0s), a1 = exp2f(m1 - b1s);
    m0 = n0;
    m1 = n1;
    float p[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      p[nt][0] = exp2f(s[nt][0] - b0s);
      p[nt][1] = exp2f(s[nt][1] - b0s);
      p[nt][2] = exp2f(s[nt][2] - b1s);
      p[nt][3] = exp2f(s[nt][3] - b1s);
    }
    l0 = l0 * a0 + ((p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
    l1 = l1 * a1 + ((p[0][2] + p[0][3]) + (p[1][2] + p[1][3]));
    if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f)) {
#pragma unroll
      for (int nt = 0; nt < NTV; ++nt) {
        o[nt][0] *= a0;
        o[nt][1] *= a0;
        o[nt][2] *= a1;
        o[nt][3] *= a1;
      }
    }
    // A fragment of P' (rows gid, gid+8; k = tile tokens 2tig, 2tig+1, 8+2tig, 9+2tig)
    uint32_t pa0, pa1, pa2, pa3, pl0, pl1, pl2, pl3;
    iq_split_h2(p[0][0] * nvs[0][0], p[0][1] * nvs[0][1], pa0, pl0);
    iq_split_h2(p[0][2] * nvs[0][0], p[0][3] * nvs[0][1], pa1, pl1);
    iq_split_h2(p[1][0] * nvs[1][0], p[1][1] * nvs[1][1], pa2, pl2);
    iq_split_h2(p[1][2] * nvs[1][0], p[1][3] * nvs[1][1], pa3, pl3);
    // V codes of the same 4 tokens at the lane's D/8 coordinates
    const uint64_t sa = iq_tc_vbits<D>(vc_ + min(2 * tig, last) * vs_, gid);
    const uint64_t sb = iq_tc_vbits<D>(vc_ + min(2 * tig + 1, last) * vs_, gid) << 4;
    const uint64_t sc = iq_tc_vbits<D>(vc_ + min(8 + 2 * tig, last) * vs_, gid) << 8;
    const uint64_t sd = iq_tc_vbits<D>(vc_ + min(9 + 2 * tig, last) * vs_, gid) << 12;
#pragma unroll
    for (int nt = 0; nt < NTV; ++nt) {
      const uint32_t sel = uint32_t(((sa >> (3 * nt)) & 0x7u) | ((sb >> (3 * nt)) & 0x70u) |
                                    ((sc >> (3 * nt)) & 0x700u) | ((sd >> (3 * nt)) & 0x7000u));
      uint32_t b0, b1;
      iq_lut4(sel, vtab, b0, b1);
      iq_mma(o[nt], pa0, pa1, pa2, pa3, b0, b1);
      if (PLO) iq_mma(o[nt], pl0, pl1, pl2, pl3, b0, b1);
    }
  };

  const bool stream = stage != nullptr && ks == KROW && vs == KROW && kns == 1 && vns == 1 &&
                      iq_aligned16(kc + long(t0) * KROW) && iq_aligned16(vc + long(t0) * KROW) &&
                      iq_aligned16(kn + t0) && iq_aligned16(vn + t0);
  if (!stream) {
    for (int tile = t0; tile < t1; tile += 16) {
      step(kc + tile * ks, ks, kn + tile * kns, kns, vc + tile * vs, vs, vn + tile * vns, vns,
           min(16, t1 - tile));
    }
  } else {
    const int ntiles = (t1 - t0 + 15) / 16;
    const long kend = long(t1) * KROW;  // bytes of the segment from the head's token 0
    // tile i -> stage i % IQ_STAGES: each lane copies a few 16-byte chunks; bytes past the
    // segment's end are not read (zero-filled), so the last row of a buffer is safe
    auto issue = [&](int i) {
      uint8_t* st = stage + (i % IQ_STAGES) * SB;
      const int tok0 = t0 + 16 * i;
      for (int c = lane; c < 2 * KROW + 4; c += 32) {
        const void* src;
        uint8_t* dst;
        long left;
        if (c < 2 * KROW) {
          const bool isv = c >= KROW;
          const long off = long(tok0) * KROW + 16 * (c - (isv ? KROW : 0));
          src = (isv ? vc : kc) + off;
          dst = st + (isv ? TK : 0) + 16 * (c - (isv ? KROW : 0));
          left = kend - off;
        } else {
          const int k = c - 2 * KROW;  // 0, 1: K norms; 2, 3: V norms (8 tokens a chunk)
          const long tok = tok0 + 8 * (k & 1);
          src = ((k < 2) ? kn : vn) + tok;
          dst = st + 2 * TK + 16 * k;
          left = 2 * (long(t1) - tok);
        }
        const int bytes = left <= 0 ? 0 : (left >= 16 ? 16 : int(left));
        iq_cp_async16(dst, bytes > 0 ? src : static_cast<const void*>(kc), bytes);
      }
    };
#pragma unroll
    for (int i = 0; i < IQ_STAGES - 1; ++i) {
      if (i < ntiles) issue(i);
      iq_cp_commit();
    }
    for (int i = 0; i < ntiles; ++i) {
      if (i + IQ_STAGES - 1 < ntiles) issue(i + IQ_STAGES - 1);
      iq_cp_commit();
      iq_cp_wait_all_but<IQ_STAGES - 1>();
      __syncwarp();
      const uint8_t* st = stage + (i % IQ_STAGES) * SB;
      step(st, KROW, reinterpret_cast<const __half*>(st + 2 * TK), 1, st + TK, KROW,
           reinterpret_cast<const __half*>(st + 2 * TK + 32), 1, min(16, t1 - (t0 + 16 * i)));
      __syncwarp();  // every lane is done with this stage before it is refilled
    }
  }
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
  for (int half_ = 0; half_ < 2; ++half_) {
    const int r = r0 + gid + 8 * half_;
    if ((R16 || half_ == 0) && r < R) {
      const long row = (long(bh) * nsp + sp) * R + r;
#pragma unroll
      for (int nt = 0; nt < NTV; ++nt) {
        po[row * D + (2 * tig) * (D / 8) + nt] = o[nt][2 * half_];
        po[row * D + (2 * tig + 1) * (D / 8) + nt] = o[nt][2 * half_ + 1];
      }
      if (tig == 0) {
        pm[row] = half_ ? m1 : m0;
        pl[row] = half_ ? l1 : l0;
      }
    }
  }
}
// @end

// @kernel iq_fused_tc
// Same grid, inputs and partials as iq_fused_scalar with RB = 16 rows per threadgroup;
// template: D, R16, KIND, CAUSAL, QLO, PLO (codes are 3-bit; QLO/PLO add the fp16 rounding
// remainder of the query / of P' as a second mma: more precision for more tensor work). Float splits use the scalar warp walk.
{
  constexpr int RB = 16;
  constexpr int KB = 3;
  constexpr int VB = 3;
  // one buffer, three uses in turn: rotation scratch, then either the warps' cp.async stages
  // (packed splits) or their probability tiles (float splits)
  constexpr int SCRATCH = RB * D * 4;
  constexpr int STAGES = IQ_NW * IQ_STAGES * IqStage<D>::BYTES;
  constexpr int PW = IQ_NW * RB * 32 * 4;
  constexpr int BUF = STAGES > SCRATCH ? (STAGES > PW ? STAGES : PW) : (SCRATCH > PW ? SCRATCH : PW);
  __shared__ float iq_qs[RB * D];
  __shared__ __align__(16) uint8_t iq_buf[BUF];
  __shared__ float iq_lk[16];
  __shared__ float iq_lv[16];
  float* iq_tmp = reinterpret_cast<float*>(iq_buf);
  float* iq_pw = reinterpret_cast<float*>(iq_buf);
  const int Tf = iparams[IQ_P_TF];
  const int L = iparams[IQ_P_L];
  const int R = iparams[IQ_P_R];
  const int G = iparams[IQ_P_G];
  const int NCB = iparams[IQ_P_NCB];
  const int Hkv = iparams[IQ_P_HKV];
  const int nsp = iparams[IQ_P_NSP];
  const int bh = iq_bz;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const bool is_fp = iq_bx >= NCB;
  const int r0 = iq_by * RB;
  const long qst[4] = {long(q_strides[0]), long(q_strides[1]), long(q_strides[2]), long(q_strides[3])};
  iq_load_q_rows<D, RB, IQ_NT>(iq_qs, q, qst, b, h, r0, R, G, L, iq_tid);
  if (iq_tid < 8) {
    iq_lk[iq_tid] = float(lv_k[iq_tid]);
    iq_lv[iq_tid] = float(lv_v[iq_tid]);
  }
  __syncthreads();
  if (!is_fp) {
    iq_rotate_rows<D, RB, KIND, IQ_NT>(iq_qs, iq_tmp, rot, h, false, iq_tid);
  }
  const float qscale = fparams[1] * (is_fp ? 1.0f : rsqrtf(float(D)));
  for (int i = iq_tid; i < RB * D; i += IQ_NT) {
    iq_qs[i] *= qscale;
  }
  __syncthreads();
  const int warp = iq_tid / 32;
  const int lane = iq_tid % 32;
  if (!is_fp) {
    const int sp = iq_bx * IQ_NW + warp;
    const int SL = iparams[IQ_P_SL];
    const int len = min(iparams[IQ_P_TC], int(lens[b]));
    const int t0 = sp * SL;
    const int t1 = min(t0 + SL, len);
    iq_tc_warp<D, R16, QLO, PLO>(
        iq_qs, iq_lk, iq_lv, k_codes + b * k_codes_strides[0] + h * k_codes_strides[1],
        long(k_codes_strides[2]), k_norms + b * k_norms_strides[0] + h * k_norms_strides[1],
        long(k_norms_strides[2]), v_codes + b * v_codes_strides[0] + h * v_codes_strides[1],
        long(v_codes_strides[2]), v_norms + b * v_norms_strides[0] + h * v_norms_strides[1],
        long(v_norms_strides[2]), t0, t1, lane, fparams[3], fparams[4],
        iq_buf + warp * IQ_STAGES * IqStage<D>::BYTES, part_o, part_m, part_l, bh, sp, nsp, r0, R);
  } else {
    float m[RB];
    float l[RB];
    float o[RB * (D / 32)];
    const int spf = (iq_bx - NCB) * IQ_NW + warp;
    const int SLF = iparams[IQ_P_SLF];
    const int t0 = spf * SLF;
    const int t1 = min(t0 + SLF, Tf);
    iq_warp_attend<D, RB, KB, VB, CAUSAL>(
        IqFloat(), iq_qs, iq_lk, iq_lv, iq_pw + warp * RB * 32,
        k_fp + b * k_fp_strides[0] + h * k_fp_strides[1], long(k_fp_strides[2]),
        k_norms, 0L, v_fp + b * v_fp_strides[0] + h * v_fp_strides[1], long(v_fp_strides[2]),
        v_norms, 0L, t0, t1, r0, L, Tf, lane, m, l, o);
    iq_store_partial<D, RB>(part_o, part_m, part_l, bh, iparams[IQ_P_NSPC] + spf, nsp, r0, R,
                            lane, m, l, o);
  }
}
// @end
