"""Compile the log-prob kernels for sm_90 without a GPU and check their memory instructions.

Run by test_logprob_triton.py in a fresh process with TRITON_INTERPRET unset. Exit status 3
means the installed Triton has no ahead-of-time compile API this script knows (test skipped).
"""
import sys

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
except ImportError as exc:
    print(f"Triton AOT API not available: {exc}")
    sys.exit(3)

import mrl_kernels.logprob_triton as kt

DIV16 = [["tt.divisibility", 16]]  # what the JIT infers at run time for 16-aligned pointers/ints
TARGET = GPUTarget("cuda", 90, 32)

compiled = 0
for dt in ("bf16", "fp16", "fp32"):
    for mode in (kt.MODE_PARTIAL, kt.MODE_ACCUMULATE, kt.MODE_FINALIZE):
        sig = {"logits_ptr": f"*{dt}", "labels_ptr": "*i64", "out_ptr": "*fp32", "V": "i32",
               "stride_row": "i64", "plane_stride": "i32", "vocab_start": "i32", "inv_temp": "fp32",
               "ignore_index": "i32", "split_size": "i32", "n_splits": "i32",
               "BLOCK_V": "constexpr", "MODE": "constexpr"}
        attrs = {(i,): DIV16 for i in (0, 1, 2, 3, 4, 9)}
        k = triton_compile(ASTSource(kt._stats_kernel, sig, {"BLOCK_V": 4096, "MODE": mode}, attrs),
                           target=TARGET, options={"num_warps": 8})
        # The logits stream must use 16-byte vector loads (8 bf16 / 4 fp32 per instruction).
        assert "ld.global.v4.b32" in k.asm["ptx"], f"stats kernel {dt} mode {mode}: no vector loads"
        compiled += 1
    sig = {"logits_ptr": f"*{dt}", "labels_ptr": "*i64", "lse_ptr": "*fp32", "mu_ptr": "*fp32",
           "glogp_ptr": "*fp32", "gent_ptr": "*fp32", "grad_ptr": f"*{dt}", "V": "i32",
           "stride_row": "i64", "stride_grad_row": "i64", "vocab_start": "i32", "inv_temp": "fp32",
           "ignore_index": "i32", "BLOCK_V": "constexpr"}
    attrs = {(i,): DIV16 for i in (0, 6, 7, 8, 9)}
    k = triton_compile(ASTSource(kt._grad_kernel, sig, {"BLOCK_V": 4096}, attrs),
                       target=TARGET, options={"num_warps": 8})
    ptx = k.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, f"grad kernel {dt}: no vector access"
    compiled += 1
print(f"compiled {compiled} kernels for sm_90")
