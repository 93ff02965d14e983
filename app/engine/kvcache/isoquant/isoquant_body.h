// IsoQuant compressed-space attention: kernel bodies shared by Metal and CUDA.
//
// Written once; a backend prologue (metal_prologue.py, cuda_prologue.py) defines
// the macros below before this text and prepends a few lines to every body that name its thread
// and group indices. Sections: "@header" (helpers, goes into `header=`) and one "@kernel NAME"
// per kernel (the function body MLX wraps in a generated signature).
//
// Prologue contract:
//   IQ_FN            helper-function qualifier        IQ_TG      threadgroup pointer qualifier
//   IQ_SHARED        threadgroup array declaration    IQ_BARRIER() / IQ_WARP_SYNC()
//   IQ_SHFL_XOR(v,m) / IQ_SHFL(v,src)  32-wide simd shuffles
//   IQ_EXP2(x)       IQ_NEG_INF       iq_u32 / iq_u64 unsigned integer types
//   body prologue:   iq_tid (thread in group), iq_bx/iq_by/iq_bz (group position in grid)
//
// Packed format (packing.py, version 2): 3-bit rows in blocks of 32 codes (three words of
// nibbles, iq_group8), 4-bit rows a nibble a code; code c means levels[c]; the vector in rotated
// space is (norm/√D)·levels[codes].
// Shapes (legends): q [B, Hq, L, D]; codes [B, Hkv, T, D*BITS/8] uint8; norms [B, Hkv, T] fp16;
// fp K/V [B, Hkv, Tf, D]; rows r = g*L + l of one KV head h are the query (head h*G+g, position l).
// Scores are kept in the log2 domain (q pre-scaled by scale*log2(e)), so softmax uses exp2.

// @header
#define IQ_NW 4     // warps (simdgroups) per threadgroup of every attention kernel
#define IQ_NT 128   // threads per threadgroup = 32 * IQ_NW

// iparams (int32[24]) of the fused kernels and the combine
#define IQ_P_TC 0     // compressed tokens (buffer length; per-row valid length comes from lens[b])
#define IQ_P_TF 1     // float tokens
#define IQ_P_L 2      // queries per head
#define IQ_P_R 3      // rows per KV head = G * L
#define IQ_P_G 4      // query heads per KV head
#define IQ_P_SL 5     // compressed tokens per warp split
#define IQ_P_NCB 6    // threadgroups a row block has for compressed tokens (the rest read float tokens)
#define IQ_P_HKV 7
#define IQ_P_NSP 8    // partials a row block has (compressed, then float ones)
#define IQ_P_NSPC 9   // of which compressed = NCB * IQ_NW (they come first)
#define IQ_P_SLF 10   // float tokens per warp split
#define IQ_P_HQ 11
#define IQ_P_SINKS 12 // 1 when the sinks input holds one logit per query head
#define IQ_P_B 13     // batch
#define IQ_P_FLO 14   // first float token's row in k_fp / v_fp (a cache's window buffer read in place)
#define IQ_P_TAB 16   // tensor-core kernel: its K level table (4 words), then V's (tc_table_words)

// Packed rows (packing.py, format 2). 3-bit rows come in blocks of 32 codes: three 32-bit
// words whose nibbles hold codes 0-23 in their low 3 bits and codes 24-31 bit-sliced across
// their top bits; 4-bit rows hold one code per nibble. Readers use byte loads: any alignment,
// any address space, nothing read past the row.

// 4 bytes at byte offset o of a row, little-endian.
template <typename P>
IQ_FN iq_u32 iq_word(P row, int o) {
  return iq_u32(row[o]) | (iq_u32(row[o + 1]) << 8) | (iq_u32(row[o + 2]) << 16) |
         (iq_u32(row[o + 3]) << 24);
}

// Codes 24-31 of a 3-bit block, one per nibble, from its three words.
IQ_FN iq_u32 iq_top8(iq_u32 w0, iq_u32 w1, iq_u32 w2) {
  return ((w0 >> 3) & 0x11111111u) | ((w1 >> 2) & 0x22222222u) | ((w2 >> 1) & 0x44444444u);
}

// Codes 8g..8g+7 of a packed row, code k in nibble k (bits 4k.., BITS of them).
template <int BITS, typename P>
IQ_FN iq_u32 iq_group8(P row, int g) {
  if (BITS == 4) {
    return iq_word(row, 4 * g);
  }
  const int o = 12 * (g >> 2);
  if ((g & 3) < 3) {
    return iq_word(row, o + 4 * (g & 3)) & 0x77777777u;
  }
  return iq_top8(iq_word(row, o), iq_word(row, o + 4), iq_word(row, o + 8));
}

// Code c of a packed row.
template <int BITS, typename P>
IQ_FN int iq_code_at(P row, int c) {
  if (BITS == 4) {
    return int((iq_u32(row[c >> 1]) >> (4 * (c & 1))) & 15u);
  }
  const int o = 12 * (c >> 5);
  const int r = c & 31;
  if (r < 24) {
    return int((iq_u32(row[o + 4 * (r >> 3) + ((r & 7) >> 1)]) >> (4 * (r & 1))) & 7u);
  }
  const int bo = o + ((r - 24) >> 1);
  const int sh = 4 * (r & 1) + 3;
  return int(((iq_u32(row[bo]) >> sh) & 1u) | (((iq_u32(row[bo + 4]) >> sh) & 1u) << 1) |
             (((iq_u32(row[bo + 8]) >> sh) & 1u) << 2));
}

IQ_FN float iq_warp_max(float v) {
  for (int m = 16; m > 0; m >>= 1) {
    v = max(v, IQ_SHFL_XOR(v, m));
  }
  return v;
}

IQ_FN float iq_warp_sum(float v) {
  for (int m = 16; m > 0; m >>= 1) {
    v += IQ_SHFL_XOR(v, m);
  }
  return v;
}

// Query rows [r0, r0 + RB) of KV head h into x ([RB][D] threadgroup floats); rows >= R are 0.
// Branch-free within a thread's elements (rows past R read row r0, which exists, and store 0; a
// decode's one query per head takes no divide), so all its loads are in flight before the first
// is used: behind per-element branches the compiler converted each load's value right after it,
// one memory round trip per element at the head of every threadgroup's set-up (H200, Nsight's
// per-instruction samples: 4 in a row).
template <int D, int RB, int NTH, bool DECODE, typename PQ, typename PS>
IQ_FN void iq_load_q_rows_(
    IQ_TG float* x, PQ q, PS qst, int b, int h, int r0, int R, int G, int L, int tid) {
  constexpr int N = (RB * D + NTH - 1) / NTH;
  float v[N];
  for (int j = 0; j < N; ++j) {
    const int i = tid + j * NTH;
    const bool ok = ((RB * D) % NTH == 0 || i < RB * D) && r0 + i / D < R;  // tid < NTH
    const int r = ok ? r0 + i / D : r0;
    const int d = ok ? i % D : 0;
    const int g = DECODE ? r : r / L;
    const int l = DECODE ? 0 : r % L;
    v[j] = float(q[b * qst[0] + (h * G + g) * qst[1] + l * qst[2] + d * qst[3]]);
    v[j] = ok ? v[j] : 0.0f;
  }
  for (int j = 0; j < N; ++j) {
    const int i = tid + j * NTH;
    if ((RB * D) % NTH == 0 || i < RB * D) {
      x[i] = v[j];
    }
  }
}
template <int D, int RB, int NTH, typename PQ, typename PS>
IQ_FN void iq_load_q_rows(
    IQ_TG float* x, PQ q, PS qst, int b, int h, int r0, int R, int G, int L, int tid) {
  if (L == 1) {
    iq_load_q_rows_<D, RB, NTH, true>(x, q, qst, b, h, r0, R, G, L, tid);
  } else {
    iq_load_q_rows_<D, RB, NTH, false>(x, q, qst, b, h, r0, R, G, L, tid);
  }
}

// Normalized Walsh–Hadamard transform (Sylvester order, = mx.hadamard_transform(x, 1/sqrt(D)))
// of RB rows of D in place. All threads call it; it ends with a barrier.
// Stage s pairs coordinates 2^s apart, indexed by shifts and masks (the loop is not unrolled:
// a divide and a modulo by 2^s per element compiled to runtime integer division).
template <int D, int RB, int NTH>
IQ_FN void iq_wht_rows(IQ_TG float* x, int tid) {
  for (int s = 0; (1 << s) < D; ++s) {
    const int hs = 1 << s;
    for (int i = tid; i < RB * D / 2; i += NTH) {
      const int r = i / (D / 2);
      const int p = i % (D / 2);
      const int a = r * D + ((p >> s) << (s + 1)) + (p & (hs - 1));
      const float u = x[a];
      const float w = x[a + hs];
      x[a] = u + w;
      x[a + hs] = u - w;
    }
    IQ_BARRIER();
  }
  const float s = 1.0f / sqrt(float(D));
  for (int i = tid; i < RB * D; i += NTH) {
    x[i] *= s;
  }
  IQ_BARRIER();
}

// The rotation of KV head h applied to RB rows of x in place (tmp: [RB][D] scratch).
// KIND 0: WHT then SO(4) blocks (v3); 1: blocks only (v1, v2); 2: dense D x D.
// rot: blocks [Hkv, D/4, 4, 4] (y = M x per block) or dense [Hkv, D, D] (y = M x).
// inverse applies R^T: blocks^T then WHT, or dense^T. Expects x complete (after a barrier).
template <int D, int RB, int KIND, int NTH, typename PR>
IQ_FN void iq_rotate_rows(IQ_TG float* x, IQ_TG float* tmp, PR rot, int h, bool inverse, int tid) {
  if (KIND == 0 && !inverse) {
    iq_wht_rows<D, RB, NTH>(x, tid);
  }
  if (KIND == 2) {
    for (int i = tid; i < RB * D; i += NTH) {
      const int r = i / D;
      const int o = i % D;
      float acc = 0.0f;
      for (int j = 0; j < D; ++j) {
        const float m = inverse ? float(rot[(h * D + j) * D + o]) : float(rot[(h * D + o) * D + j]);
        acc += m * x[r * D + j];
      }
      tmp[i] = acc;
    }
    IQ_BARRIER();
    for (int i = tid; i < RB * D; i += NTH) {
      x[i] = tmp[i];
    }
    IQ_BARRIER();
  } else {
    for (int i = tid; i < RB * D / 4; i += NTH) {
      const int r = i / (D / 4);
      const int blk = i % (D / 4);
      const int mb = (h * (D / 4) + blk) * 16;
      IQ_TG float* v = x + r * D + 4 * blk;
      const float v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];
      float y[4];
      for (int a = 0; a < 4; ++a) {
        if (inverse) {
          y[a] = float(rot[mb + a]) * v0 + float(rot[mb + 4 + a]) * v1 + float(rot[mb + 8 + a]) * v2 +
                 float(rot[mb + 12 + a]) * v3;
        } else {
          y[a] = float(rot[mb + 4 * a]) * v0 + float(rot[mb + 4 * a + 1]) * v1 +
                 float(rot[mb + 4 * a + 2]) * v2 + float(rot[mb + 4 * a + 3]) * v3;
        }
      }
      v[0] = y[0];
      v[1] = y[1];
      v[2] = y[2];
      v[3] = y[3];
    }
    IQ_BARRIER();
    if (KIND == 0 && inverse) {
      iq_wht_rows<D, RB, NTH>(x, tid);
    }
  }
}

// The normalized WHT (Sylvester order, = iq_wht_rows) of a row of D <= 128 coordinates held by
// D/4 lanes, lane j holding coordinates 4j..4j+3 in y: strides 1 and 2 in registers, 4 .. D/2
// by xor shuffles, no barrier. Every lane of the warp calls it (with D < 128 the shuffles stay
// within groups of D/4 lanes, so each group may hold its own row).
template <int D>
IQ_FN void iq_wht_row_warp(IQ_THREAD float* y, int j) {
  const float a = y[0] + y[1], b = y[0] - y[1], c = y[2] + y[3], d = y[2] - y[3];
  y[0] = a + c;
  y[1] = b + d;
  y[2] = a - c;
  y[3] = b - d;
  for (int m = 1; m < D / 4; m <<= 1) {
    const bool upper = (j & m) != 0;
    for (int e = 0; e < 4; ++e) {
      const float p = IQ_SHFL_XOR(y[e], m);
      y[e] = upper ? p - y[e] : y[e] + p;
    }
  }
  const float s = 1.0f / sqrt(float(D));
  for (int e = 0; e < 4; ++e) {
    y[e] *= s;
  }
}

// R^T of one row of D <= 128 coordinates in place, by one warp (D/4 lanes, lane j holding
// coordinates 4j..4j+3, i.e. SO(4) block j; the other lanes idle): block j transposed, then
// (KIND 0) iq_wht_row_warp. No barrier inside (iq_rotate_rows takes ~10 for one row).
// rot: blocks [Hkv, D/4, 4, 4]. KIND 0 or 1 only.
template <int D, int KIND, typename PR>
IQ_FN void iq_inverse_rotate_row_warp(IQ_TG float* x, PR rot, int h, int lane) {
  const int j = lane % (D / 4);
  const int mb = (h * (D / 4) + j) * 16;
  float v[4];
  for (int e = 0; e < 4; ++e) {
    v[e] = x[4 * j + e];
  }
  float y[4];
  for (int a = 0; a < 4; ++a) {
    y[a] = float(rot[mb + a]) * v[0] + float(rot[mb + 4 + a]) * v[1] +
           float(rot[mb + 8 + a]) * v[2] + float(rot[mb + 12 + a]) * v[3];
  }
  if (KIND == 0) {
    iq_wht_row_warp<D>(y, j);
  }
  if (lane < D / 4) {
    for (int e = 0; e < 4; ++e) {
      x[4 * j + e] = y[e];
    }
  }
}

// Token sources of a warp walk: packed codes (scores against the rotated query, values in
// rotated space) or float K/V (plain query). Tag dispatch keeps each instantiation to one kind.
struct IqPacked {};
struct IqFloat {};

// s[r] += <qs[r], k_j>: packed row j of `kc` (stride ks) scaled by its norm.
template <int D, int RB, int KB, typename PKC, typename PKN>
IQ_FN void iq_token_scores(IqPacked, IQ_THREAD float* s, IQ_TG const float* qs,
                           IQ_TG const float* lvk, PKC kc, long ks, PKN kn, long kns, int j) {
  for (int g = 0; g < D / 8; ++g) {
    const iq_u32 w = iq_group8<KB>(kc + j * ks, g);
    float lv[8];
    for (int k = 0; k < 8; ++k) {
      lv[k] = lvk[(w >> (4 * k)) & ((1u << KB) - 1u)];
    }
    for (int r = 0; r < RB; ++r) {
      IQ_TG const float* qr = qs + r * D + 8 * g;
      float acc = s[r];
      for (int k = 0; k < 8; ++k) {
        acc += qr[k] * lv[k];
      }
      s[r] = acc;
    }
  }
  const float nk = float(kn[j * kns]);
  for (int r = 0; r < RB; ++r) {
    s[r] *= nk;
  }
}

template <int D, int RB, int KB, typename PKC, typename PKN>
IQ_FN void iq_token_scores(IqFloat, IQ_THREAD float* s, IQ_TG const float* qs,
                           IQ_TG const float* lvk, PKC kc, long ks, PKN kn, long kns, int j) {
  for (int d = 0; d < D; d += 4) {
    const float k0 = float(kc[j * ks + d]);
    const float k1 = float(kc[j * ks + d + 1]);
    const float k2 = float(kc[j * ks + d + 2]);
    const float k3 = float(kc[j * ks + d + 3]);
    for (int r = 0; r < RB; ++r) {
      s[r] += qs[r * D + d] * k0 + qs[r * D + d + 1] * k1 + qs[r * D + d + 2] * k2 +
              qs[r * D + d + 3] * k3;
    }
  }
}

// Weight of token j's value: norm/sqrt(D) for packed rows, 1 for float rows.
template <int D, typename PVN>
IQ_FN float iq_value_scale(IqPacked, PVN vn, long vns, int j) {
  return float(vn[j * vns]) / sqrt(float(D));
}

template <int D, typename PVN>
IQ_FN float iq_value_scale(IqFloat, PVN vn, long vns, int j) {
  return 1.0f;
}

// v[k] = value coordinate lane*CPL + k of token j.
template <int D, int VB, typename PVC>
IQ_FN void iq_token_values(IqPacked, IQ_THREAD float* v, IQ_TG const float* lvv, PVC vc, long vs,
                           int j, int lane) {
  constexpr int CPL = D / 32;
  iq_u32 w = 0u;
  for (int k = 0; k < CPL; ++k) {
    const int c = lane * CPL + k;  // a group of 8 holds all CPL < 8 codes of a lane
    if (k % 8 == 0) {
      w = iq_group8<VB>(vc + j * vs, c >> 3) >> (4 * (c & 7));
    }
    v[k] = lvv[(w >> (4 * (k % 8))) & ((1u << VB) - 1u)];
  }
}

template <int D, int VB, typename PVC>
IQ_FN void iq_token_values(IqFloat, IQ_THREAD float* v, IQ_TG const float* lvv, PVC vc, long vs,
                           int j, int lane) {
  constexpr int CPL = D / 32;
  for (int k = 0; k < CPL; ++k) {
    v[k] = float(vc[j * vs + lane * CPL + k]);
  }
}

// One warp's walk over tokens [t0, t1) of one segment with an online softmax for RB rows.
// qs: [RB][D] pre-scaled query rows; lvk/lvv: levels; pw: this warp's [RB][32] probability
// tile. Scores are computed one token per lane; lane owns output coordinates
// [lane*CPL, lane*CPL + CPL). Outputs m (row max, log2 domain), l (row sum), o (unnormalized).
// CAUSAL masks float token j for row r when j > Tf - L + (r0 + r) % L.
template <int D, int RB, int KB, int VB, bool CAUSAL, typename SRC, typename PKC, typename PKN,
          typename PVC, typename PVN>
IQ_FN void iq_warp_attend(
    SRC src, IQ_TG const float* qs, IQ_TG const float* lvk, IQ_TG const float* lvv, IQ_TG float* pw,
    PKC kc, long ks, PKN kn, long kns, PVC vc, long vs, PVN vn, long vns, int t0, int t1,
    int r0, int L, int Tf, int lane, IQ_THREAD float* m, IQ_THREAD float* l,
    IQ_THREAD float* o) {
  constexpr int CPL = D / 32;
  for (int r = 0; r < RB; ++r) {
    m[r] = IQ_NEG_INF;
    l[r] = 0.0f;
    for (int k = 0; k < CPL; ++k) {
      o[r * CPL + k] = 0.0f;
    }
  }
  for (int tile = t0; tile < t1; tile += 32) {
    const int j = tile + lane;
    const bool valid = j < t1;
    float s[RB];
    for (int r = 0; r < RB; ++r) {
      s[r] = 0.0f;
    }
    float pscale = 0.0f;
    if (valid) {
      iq_token_scores<D, RB, KB>(src, s, qs, lvk, kc, ks, kn, kns, j);
      pscale = iq_value_scale<D>(src, vn, vns, j);
    }
    for (int r = 0; r < RB; ++r) {
      bool ok = valid;
      if (CAUSAL) {
        ok = ok && (j <= Tf - L + (r0 + r) % L);
      }
      s[r] = ok ? s[r] : IQ_NEG_INF;
    }
    for (int r = 0; r < RB; ++r) {
      const float mt = iq_warp_max(s[r]);
      const float mn = max(m[r], mt);
      const float base = mn == IQ_NEG_INF ? 0.0f : mn;
      const float alpha = IQ_EXP2(m[r] - base);
      const float p = IQ_EXP2(s[r] - base);
      l[r] = l[r] * alpha + p;
      m[r] = mn;
      for (int k = 0; k < CPL; ++k) {
        o[r * CPL + k] *= alpha;
      }
      pw[r * 32 + lane] = p * pscale;
    }
    IQ_WARP_SYNC();
    // U tokens' values are loaded before any is used (one round trip per U tokens, not per
    // token); indices past the tile's end repeat its last token, whose weight there is 0
    const int nt = min(32, t1 - tile);
    constexpr int U = CPL >= 32 ? 1 : 32 / CPL;
    for (int t = 0; t < nt; t += U) {
      float v[U][CPL];
      for (int u = 0; u < U; ++u) {
        iq_token_values<D, VB>(src, v[u], lvv, vc, vs, tile + min(t + u, nt - 1), lane);
      }
      for (int u = 0; u < U; ++u) {
        for (int r = 0; r < RB; ++r) {
          const float pr = pw[r * 32 + t + u];
          for (int k = 0; k < CPL; ++k) {
            o[r * CPL + k] += pr * v[u][k];
          }
        }
      }
    }
    IQ_WARP_SYNC();
  }
  for (int r = 0; r < RB; ++r) {
    l[r] = iq_warp_sum(l[r]);
  }
}

// Store one warp's partial (m, l, O) for rows [r0, r0 + RB) of split `sp`.
// po: [B*Hkv, NSP, R, D]; pm, pl: [B*Hkv, NSP, R]. O coordinates: lane*CPL + k.
template <int D, int RB, typename PO>
IQ_FN void iq_store_partial(
    PO po, PO pm, PO pl, int bh, int sp, int nsp, int r0, int R, int lane,
    IQ_THREAD const float* m, IQ_THREAD const float* l, IQ_THREAD const float* o) {
  constexpr int CPL = D / 32;
  for (int r = 0; r < RB; ++r) {
    if (r0 + r < R) {
      const long row = (long(bh) * nsp + sp) * R + r0 + r;
      for (int k = 0; k < CPL; ++k) {
        po[row * D + lane * CPL + k] = o[r * CPL + k];
      }
      if (lane == 0) {
        pm[row] = m[r];
        pl[row] = l[r];
      }
    }
  }
}
// @end

// @kernel iq_fused_scalar
// Split-K single pass: one warp per split. grid (x: 128 * (NCB + NFB), y: row blocks of RB,
// z: B*Hkv); threadgroups x < NCB read packed tokens, the others float tokens.
// template: D, RB, KB, VB, KIND, CAUSAL. Outputs part_o [B*Hkv, NSP, R, D], part_m/part_l
// [B*Hkv, NSP, R] (compressed splits in rotated space, float splits in model space).
{
  IQ_SHARED float iq_qs[RB * D];
  IQ_SHARED float iq_tmp[RB * D];
  IQ_SHARED float iq_lk[16];
  IQ_SHARED float iq_lv[16];
  IQ_SHARED float iq_pw[IQ_NW * RB * 32];
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
  if (iq_tid < (1 << KB)) {
    iq_lk[iq_tid] = float(lv_k[iq_tid]);
  }
  if (iq_tid < (1 << VB)) {
    iq_lv[iq_tid] = float(lv_v[iq_tid]);
  }
  IQ_BARRIER();
  if (!is_fp) {
    iq_rotate_rows<D, RB, KIND, IQ_NT>(iq_qs, iq_tmp, rot, h, false, iq_tid);
  }
  // log2 domain; the 1/sqrt(D) of packed keys is folded into the rotated query
  const float qscale = fparams[1] * (is_fp ? 1.0f : 1.0f / sqrt(float(D)));
  for (int i = iq_tid; i < RB * D; i += IQ_NT) {
    iq_qs[i] *= qscale;
  }
  IQ_BARRIER();
  const int warp = iq_tid / 32;
  const int lane = iq_tid % 32;
  float m[RB];
  float l[RB];
  float o[RB * (D / 32)];
  if (!is_fp) {
    const int sp = iq_bx * IQ_NW + warp;
    const int SL = iparams[IQ_P_SL];
    const int len = min(iparams[IQ_P_TC], int(lens[b]));
    const int t0 = sp * SL;
    const int t1 = min(t0 + SL, len);
    iq_warp_attend<D, RB, KB, VB, false>(
        IqPacked(), iq_qs, iq_lk, iq_lv, iq_pw + warp * RB * 32,
        k_codes + b * k_codes_strides[0] + h * k_codes_strides[1], long(k_codes_strides[2]),
        k_norms + b * k_norms_strides[0] + h * k_norms_strides[1], long(k_norms_strides[2]),
        v_codes + b * v_codes_strides[0] + h * v_codes_strides[1], long(v_codes_strides[2]),
        v_norms + b * v_norms_strides[0] + h * v_norms_strides[1], long(v_norms_strides[2]),
        t0, t1, r0, L, Tf, lane, m, l, o);
    iq_store_partial<D, RB>(part_o, part_m, part_l, bh, sp, nsp, r0, R, lane, m, l, o);
  } else {
    const int spf = (iq_bx - NCB) * IQ_NW + warp;
    const int SLF = iparams[IQ_P_SLF];
    const long flo = long(iparams[IQ_P_FLO]);
    const int t0 = spf * SLF;
    const int t1 = min(t0 + SLF, Tf);
    iq_warp_attend<D, RB, KB, VB, CAUSAL>(
        IqFloat(), iq_qs, iq_lk, iq_lv, iq_pw + warp * RB * 32,
        k_fp + b * k_fp_strides[0] + h * k_fp_strides[1] + flo * k_fp_strides[2],
        long(k_fp_strides[2]), k_norms, 0L,
        v_fp + b * v_fp_strides[0] + h * v_fp_strides[1] + flo * v_fp_strides[2],
        long(v_fp_strides[2]),
        v_norms, 0L, t0, t1, r0, L, Tf, lane, m, l, o);
    iq_store_partial<D, RB>(part_o, part_m, part_l, bh, iparams[IQ_P_NSPC] + spf, nsp, r0, R,
                            lane, m, l, o);
  }
}
// @end

// @kernel iq_combine
// Log-sum-exp merge of all splits of one row (compressed splits [0, NSPC), float splits after),
// inverse rotation of the compressed part, plus the float part, divided by the total weight
// (sink included). grid (IQ_CT, R, B*Hkv), group IQ_CT = 256 threads: the 8 warps share the
// splits (warp w takes w, w + 8, ...; each lane D/32 coordinates, loads coalesced and many in
// flight), then add their sums in threadgroup memory. template: D, KIND, TO.
{
  constexpr int CT = 256;
  constexpr int CW = CT / 32;
  constexpr int V = D / 32;
  IQ_SHARED float iq_x[D];
  IQ_SHARED float iq_tmp[D];
  IQ_SHARED float iq_red[CW * D];
  IQ_SHARED float iq_wred[CW];
  const int R = iparams[IQ_P_R];
  const int L = iparams[IQ_P_L];
  const int G = iparams[IQ_P_G];
  const int Hkv = iparams[IQ_P_HKV];
  const int nsp = iparams[IQ_P_NSP];
  const int nspc = iparams[IQ_P_NSPC];
  const int bh = iq_bz;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const int r = iq_by;
  const int g = r / L;
  const int l = r % L;
  const int warp = iq_tid / 32;
  const int lane = iq_tid % 32;
  const long base = long(bh) * nsp * R + r;  // row r of split 0
  float M = IQ_NEG_INF;
  for (int s = iq_tid; s < nsp; s += CT) {
    M = max(M, part_m[base + long(s) * R]);
  }
  M = iq_warp_max(M);
  if (lane == 0) {
    iq_wred[warp] = M;
  }
  IQ_BARRIER();
  M = iq_wred[0];
  for (int w = 1; w < CW; ++w) {
    M = max(M, iq_wred[w]);
  }
  float sink = IQ_NEG_INF;
  if (iparams[IQ_P_SINKS] != 0) {
    sink = float(sinks[h * G + g]) * fparams[2];  // natural-log logit -> log2 domain
    M = max(M, sink);
  }
  const float mb = M == IQ_NEG_INF ? 0.0f : M;
  float tot = 0.0f;  // this warp's splits (the same on every lane)
  float oc[V];
  float of[V];
  for (int i = 0; i < V; ++i) {
    oc[i] = 0.0f;
    of[i] = 0.0f;
  }
  for (int s = warp; s < nspc; s += CW) {
    const long row = base + long(s) * R;
    const float w = IQ_EXP2(part_m[row] - mb);
    tot += w * part_l[row];
    for (int i = 0; i < V; ++i) {
      oc[i] += w * part_o[row * D + lane + 32 * i];
    }
  }
  for (int s = nspc + warp; s < nsp; s += CW) {
    const long row = base + long(s) * R;
    const float w = IQ_EXP2(part_m[row] - mb);
    tot += w * part_l[row];
    for (int i = 0; i < V; ++i) {
      of[i] += w * part_o[row * D + lane + 32 * i];
    }
  }
  IQ_BARRIER();  // every thread has read iq_wred
  if (lane == 0) {
    iq_wred[warp] = tot;
  }
  for (int i = 0; i < V; ++i) {
    iq_red[warp * D + lane + 32 * i] = oc[i];
  }
  IQ_BARRIER();
  tot = IQ_EXP2(sink - mb);
  for (int w = 0; w < CW; ++w) {
    tot += iq_wred[w];
  }
  for (int d = iq_tid; d < D; d += CT) {
    float acc = 0.0f;
    for (int w = 0; w < CW; ++w) {
      acc += iq_red[w * D + d];
    }
    iq_x[d] = acc;
  }
  IQ_BARRIER();
  for (int i = 0; i < V; ++i) {
    iq_red[warp * D + lane + 32 * i] = of[i];
  }
  if (KIND != 2 && D <= 128) {
    if (warp == 0) {
      iq_inverse_rotate_row_warp<D, KIND>(iq_x, rot, h, lane);
    }
    IQ_BARRIER();
  } else {
    iq_rotate_rows<D, 1, KIND, CT>(iq_x, iq_tmp, rot, h, true, iq_tid);  // ends with a barrier
  }
  const float inv = tot > 0.0f ? 1.0f / tot : 0.0f;
  const long ob = ((long(b) * iparams[IQ_P_HQ] + h * G + g) * L + l) * D;
  for (int d = iq_tid; d < D; d += CT) {
    float acc = iq_x[d];
    for (int w = 0; w < CW; ++w) {
      acc += iq_red[w * D + d];
    }
    out[ob + d] = static_cast<TO>(acc * inv);
  }
}
// @end

// @kernel iq_qk_dot
// Kernel A: scores[b, h, r, j] = scale * (norm_j / sqrt(D)) * <R q_r, levels[codes_j]> for every
// compressed token (no mask). One token per thread: grid (128 * ceil(Tc / 128), ceil(R / RB),
// B*Hkv), group 128. template: D, RB, KB, KIND. Output scores [B*Hkv, R, Tc] float32.
{
  IQ_SHARED float iq_qs[RB * D];
  IQ_SHARED float iq_tmp[RB * D];
  IQ_SHARED float iq_lk[16];
  const int Tc = iparams[IQ_P_TC];
  const int L = iparams[IQ_P_L];
  const int R = iparams[IQ_P_R];
  const int G = iparams[IQ_P_G];
  const int Hkv = iparams[IQ_P_HKV];
  const int bh = iq_bz;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const int r0 = iq_by * RB;
  const long qst[4] = {long(q_strides[0]), long(q_strides[1]), long(q_strides[2]), long(q_strides[3])};
  iq_load_q_rows<D, RB, IQ_NT>(iq_qs, q, qst, b, h, r0, R, G, L, iq_tid);
  if (iq_tid < (1 << KB)) {
    iq_lk[iq_tid] = float(lv_k[iq_tid]);
  }
  IQ_BARRIER();
  iq_rotate_rows<D, RB, KIND, IQ_NT>(iq_qs, iq_tmp, rot, h, false, iq_tid);
  const int j = iq_bx * IQ_NT + iq_tid;
  if (j < Tc) {
    float s[RB];
    for (int r = 0; r < RB; ++r) {
      s[r] = 0.0f;
    }
    iq_token_scores<D, RB, KB>(
        IqPacked(), s, iq_qs, iq_lk,
        k_codes + b * k_codes_strides[0] + h * k_codes_strides[1], long(k_codes_strides[2]),
        k_norms + b * k_norms_strides[0] + h * k_norms_strides[1], long(k_norms_strides[2]), j);
    const float f = fparams[0] / sqrt(float(D));
    for (int r = 0; r < RB; ++r) {
      if (r0 + r < R) {
        scores[(long(bh) * R + r0 + r) * Tc + j] = s[r] * f;
      }
    }
  }
}
// @end

// @kernel iq_softmax
// Kernel B: probs = softmax over the T = Tc + Tf scores of a row (natural units); compressed
// column j is masked when j >= lens[b], float column Tc + i when CAUSAL and i > Tf - L + l;
// an optional sink logit joins the normalizer. grid (128, R, B*Hkv), group 128.
// scores, probs: [B*Hkv, R, T] float32.
{
  IQ_SHARED float iq_red[IQ_NW];
  const int Tc = iparams[IQ_P_TC];
  const int Tf = iparams[IQ_P_TF];
  const int L = iparams[IQ_P_L];
  const int R = iparams[IQ_P_R];
  const int G = iparams[IQ_P_G];
  const int Hkv = iparams[IQ_P_HKV];
  const int T = Tc + Tf;
  const int bh = iq_bz;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const int r = iq_by;
  const int l = r % L;
  const int len = min(Tc, int(lens[b]));
  const long ro = (long(bh) * R + r) * T;
  const int warp = iq_tid / 32;
  const int lane = iq_tid % 32;
  const float LOG2E = 1.4426950408889634f;
  float mx = IQ_NEG_INF;
  for (int j = iq_tid; j < T; j += IQ_NT) {
    const bool ok = j < Tc ? j < len : (!CAUSAL || j - Tc <= Tf - L + l);
    if (ok) {
      mx = max(mx, scores[ro + j]);
    }
  }
  float sink = IQ_NEG_INF;
  if (iparams[IQ_P_SINKS] != 0) {
    sink = float(sinks[h * G + r / L]);
  }
  mx = iq_warp_max(max(mx, sink));
  if (lane == 0) {
    iq_red[warp] = mx;
  }
  IQ_BARRIER();
  mx = max(max(iq_red[0], iq_red[1]), max(iq_red[2], iq_red[3]));
  IQ_BARRIER();
  const float mb = mx == IQ_NEG_INF ? 0.0f : mx;
  float sum = 0.0f;
  for (int j = iq_tid; j < T; j += IQ_NT) {
    const bool ok = j < Tc ? j < len : (!CAUSAL || j - Tc <= Tf - L + l);
    if (ok) {
      sum += IQ_EXP2((scores[ro + j] - mb) * LOG2E);
    }
  }
  sum = iq_warp_sum(sum);
  if (lane == 0) {
    iq_red[warp] = sum;
  }
  IQ_BARRIER();
  sum = iq_red[0] + iq_red[1] + iq_red[2] + iq_red[3] + IQ_EXP2((sink - mb) * LOG2E);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int j = iq_tid; j < T; j += IQ_NT) {
    const bool ok = j < Tc ? j < len : (!CAUSAL || j - Tc <= Tf - L + l);
    probs[ro + j] = ok ? IQ_EXP2((scores[ro + j] - mb) * LOG2E) * inv : 0.0f;
  }
}
// @end

// @kernel iq_value_word
// Kernel C, word-parallel schedule (T < 512): thread (word = group of 8 coordinates, token lane)
// adds p * norm/sqrt(D) * levels[code] over its tokens; token lanes are summed in threadgroup
// memory. probs: [B*Hkv, R, Tp] (columns [0, Tc) are the compressed tokens). grid (256, R/RB,
// B*Hkv), group 256. template: D, RB, VB. Output acc [B*Hkv, R, D], rotated space.
{
  constexpr int NG = D / 8;
  constexpr int TL = 256 / NG;  // token lanes
  IQ_SHARED float iq_lv[16];
  IQ_SHARED float iq_red[256 * 8];
  const int Tc = iparams[IQ_P_TC];
  const int R = iparams[IQ_P_R];
  const int Tp = iparams[IQ_P_SL];  // row stride of probs
  const int Hkv = iparams[IQ_P_HKV];
  const int bh = iq_bz;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const int r0 = iq_by * RB;
  const int gi = iq_tid % NG;
  const int tl = iq_tid / NG;
  const int len = min(Tc, int(lens[b]));
  if (iq_tid < (1 << VB)) {
    iq_lv[iq_tid] = float(lv_v[iq_tid]);
  }
  IQ_BARRIER();
  float acc[RB * 8];
  for (int i = 0; i < RB * 8; ++i) {
    acc[i] = 0.0f;
  }
  const float inv_sqrt_d = 1.0f / sqrt(float(D));
  const long vb = b * v_codes_strides[0] + h * v_codes_strides[1];
  const long nb = b * v_norms_strides[0] + h * v_norms_strides[1];
  for (int j = tl; j < len; j += TL) {
    const iq_u32 w = iq_group8<VB>(v_codes + vb + j * v_codes_strides[2], gi);
    const float f = float(v_norms[nb + j * v_norms_strides[2]]) * inv_sqrt_d;
    float lv[8];
    for (int k = 0; k < 8; ++k) {
      lv[k] = iq_lv[(w >> (4 * k)) & ((1u << VB) - 1u)];
    }
    for (int r = 0; r < RB; ++r) {
      const int rr = min(r0 + r, R - 1);
      const float p = probs[(long(bh) * R + rr) * Tp + j] * f;
      for (int k = 0; k < 8; ++k) {
        acc[r * 8 + k] += p * lv[k];
      }
    }
  }
  // [TL][D] partial sums of one row at a time; thread d < D then sums its column
  for (int r = 0; r < RB; ++r) {
    for (int k = 0; k < 8; ++k) {
      iq_red[tl * D + gi * 8 + k] = acc[r * 8 + k];
    }
    IQ_BARRIER();
    for (int c = iq_tid; c < D && r0 + r < R; c += 256) {
      float t = 0.0f;
      for (int i = 0; i < TL; ++i) {
        t += iq_red[i * D + c];
      }
      out[(long(bh) * R + r0 + r) * D + c] = t;
    }
    IQ_BARRIER();
  }
}
// @end

// @kernel iq_value_dim
// Kernel C, dimension-parallel schedule (T >= 512): thread d owns coordinate d for RB rows and
// walks the tokens of its split; the caller sums the splits. grid (D, ceil(R/RB) * S, B*Hkv),
// group D. template: D, RB, VB. Output part [S, B*Hkv, R, D], rotated space.
{
  IQ_SHARED float iq_lv[16];
  const int Tc = iparams[IQ_P_TC];
  const int R = iparams[IQ_P_R];
  const int Tp = iparams[IQ_P_SL];
  const int Hkv = iparams[IQ_P_HKV];
  const int SLD = iparams[IQ_P_SLF];  // tokens per split
  const int nbh = iparams[IQ_P_B] * Hkv;
  const int nrb = (R + RB - 1) / RB;
  const int bh = iq_bz;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const int rb = iq_by % nrb;
  const int sp = iq_by / nrb;
  const int r0 = rb * RB;
  const int d = iq_tid;
  const int len = min(Tc, int(lens[b]));
  if (iq_tid < (1 << VB)) {
    iq_lv[iq_tid] = float(lv_v[iq_tid]);
  }
  IQ_BARRIER();
  float acc[RB];
  for (int r = 0; r < RB; ++r) {
    acc[r] = 0.0f;
  }
  const float inv_sqrt_d = 1.0f / sqrt(float(D));
  const long vb = b * v_codes_strides[0] + h * v_codes_strides[1];
  const long nb = b * v_norms_strides[0] + h * v_norms_strides[1];
  const int t1 = min(len, (sp + 1) * SLD);
  for (int j = sp * SLD; j < t1; ++j) {
    const float lv = iq_lv[iq_code_at<VB>(v_codes + vb + j * v_codes_strides[2], d)];
    const float f = float(v_norms[nb + j * v_norms_strides[2]]) * inv_sqrt_d * lv;
    for (int r = 0; r < RB; ++r) {
      const int rr = min(r0 + r, R - 1);
      acc[r] += probs[(long(bh) * R + rr) * Tp + j] * f;
    }
  }
  for (int r = 0; r < RB; ++r) {
    if (r0 + r < R) {
      part[((long(sp) * nbh + bh) * R + r0 + r) * D + d] = acc[r];
    }
  }
}
// @end

// @kernel iq_rotate_inverse
// Kernel D: o = R^T acc (+ add), one row per threadgroup: grid (D, R, B*Hkv), group D.
// acc: [B*Hkv, R, D] float32 (rotated space); add, out: [B, Hq, L, D]. template: D, KIND, ADD, TO.
{
  IQ_SHARED float iq_x[D];
  IQ_SHARED float iq_tmp[D];
  const int R = iparams[IQ_P_R];
  const int L = iparams[IQ_P_L];
  const int G = iparams[IQ_P_G];
  const int Hkv = iparams[IQ_P_HKV];
  const int bh = iq_bz;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const int r = iq_by;
  const int d = iq_tid;
  iq_x[d] = acc[(long(bh) * R + r) * D + d];
  IQ_BARRIER();
  iq_rotate_rows<D, 1, KIND, D>(iq_x, iq_tmp, rot, h, true, iq_tid);
  const long oi = ((long(b) * iparams[IQ_P_HQ] + h * G + r / L) * L + r % L) * D + d;
  float v = iq_x[d];
  if (ADD) {
    v += float(add[oi]);
  }
  out[oi] = static_cast<TO>(v);
}
// @end

// @kernel iq_encode
// Decode-time compression of K and V rows into the cache's packed format (packing.py), one row
// per threadgroup of D threads, both tensors in one launch: y = R x (float32, the rotation of
// KV head h as iq_rotate_rows), norm = |y|, u = y * sqrt(D) / max(norm, 1e-30),
// code = #{thresholds < u}, packed (3-bit: blocks of 32 codes in 12 bytes, packing.py; 4-bit:
// two a byte, low nibble first), norm stored as HT (fp16) clamped to 65504. The math of
// quantizer.encode (the MLX-ops path); codes agree except where float rounding puts u within
// ~1e-6 of a threshold. x_k, x_v: [B, Hkv, N, D] views (any strides).
// grid (D, N, B*Hkv*2), z = (b*Hkv + h)*2 + (0: K, 1: V); group D. template: D, KIND, KB, VB, HT.
{
  IQ_SHARED float iq_x[D];
  IQ_SHARED float iq_tmp[D];
  IQ_SHARED float iq_wsum[D / 32];
  IQ_SHARED int iq_code[D];
  const int Hkv = iparams[0];
  const int N = iparams[1];
  const int n = iq_by;
  const int kv = iq_bz % 2;
  const int bh = iq_bz / 2;
  const int b = bh / Hkv;
  const int h = bh % Hkv;
  const int d = iq_tid;
  if (kv == 0) {
    iq_x[d] = float(x_k[b * x_k_strides[0] + h * x_k_strides[1] + n * x_k_strides[2] +
                        d * x_k_strides[3]]);
  } else {
    iq_x[d] = float(x_v[b * x_v_strides[0] + h * x_v_strides[1] + n * x_v_strides[2] +
                        d * x_v_strides[3]]);
  }
  IQ_BARRIER();
  iq_rotate_rows<D, 1, KIND, D>(iq_x, iq_tmp, rot, h, false, iq_tid);  // ends with a barrier
  const float y = iq_x[d];
  const float ss = iq_warp_sum(y * y);
  if (d % 32 == 0) {
    iq_wsum[d / 32] = ss;
  }
  IQ_BARRIER();
  float norm2 = 0.0f;
  for (int w = 0; w < D / 32; ++w) {
    norm2 += iq_wsum[w];
  }
  const float norm = sqrt(norm2);
  const float u = y * (sqrt(float(D)) / max(norm, 1e-30f));
  const int bits = kv == 0 ? KB : VB;
  int c = 0;
  for (int t = 0; t < (1 << bits) - 1; ++t) {
    c += u > float(kv == 0 ? thr_k[t] : thr_v[t]) ? 1 : 0;
  }
  iq_code[d] = c;
  IQ_BARRIER();
  const long row = long(bh) * N + n;
  if (bits == 3) {
    if (d % 32 < 3) {  // word j = d % 32 of block d / 32 (packing.py)
      const int c0 = d - d % 32;
      const int j = d % 32;
      iq_u32 w = 0u;
      for (int k = 0; k < 8; ++k) {
        const iq_u32 top = (iq_u32(iq_code[c0 + 24 + k]) >> j) & 1u;
        w |= (iq_u32(iq_code[c0 + 8 * j + k]) | (top << 3)) << (4 * k);
      }
      const long o = row * (3 * D / 8) + 12 * (c0 / 32) + 4 * j;
      for (int i = 0; i < 4; ++i) {
        if (kv == 0) {
          kc[o + i] = uint8_t((w >> (8 * i)) & 0xFFu);
        } else {
          vc[o + i] = uint8_t((w >> (8 * i)) & 0xFFu);
        }
      }
    }
  } else if (d % 2 == 0) {
    const uint8_t v = uint8_t(iq_code[d] | (iq_code[d + 1] << 4));
    if (kv == 0) {
      kc[row * (D / 2) + d / 2] = v;
    } else {
      vc[row * (D / 2) + d / 2] = v;
    }
  }
  if (d == 0) {
    const HT nv = static_cast<HT>(min(norm, 65504.0f));
    if (kv == 0) {
      kn[row] = nv;
    } else {
      vn[row] = nv;
    }
  }
}
// @end
