// The constants of SLEEF's expf_u10, which torch's vectorized CPU kernels call for fp32 exp:
// d = q ln2 + s with q = round(d log2(e)) and ln2 in two parts, exp(s) by a polynomial, then
// 2^q. The engine's exp forms (silu_mul.cpp's scalar one, vec512.h's 16 lanes, vec256.h's 8)
// use these, so that they round as eager's exp does, to within an ulp.
#pragma once

namespace sleef_expf {

constexpr float kLog2e = 1.442695040888963407359924681001892137426645954152985934135449406931f;
constexpr float kLn2High = 0.693145751953125f;
constexpr float kLn2Low = 1.428606765330187045e-06f;
// exp(s) ~ 1 + s + s^2 (c0 s^5 + c1 s^4 + ... + c5), Horner's scheme from c0
constexpr float kPoly[] = {0.000198527617612853646278381f, 0.00139304355252534151077271f,
                           0.00833336077630519866943359f,  0.0416664853692054748535156f,
                           0.166666671633720397949219f,    0.5f};
constexpr int kDegree = sizeof(kPoly) / sizeof(kPoly[0]);

}  // namespace sleef_expf
