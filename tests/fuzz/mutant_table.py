"""The planted miscompiles `tests/fuzz/mutants.py` runs (see its docstring).

Each entry is a realistic one-line bug in one area (op decompositions, VJP rules, dtypes,
layout, mutation, codegen kernels, guards, the autograd bridge, passes) and the pytest subset
of `make test` expected to catch it. Keep `old` short but unique in its file; the harness
refuses an entry whose text does not occur exactly once.
"""

from __future__ import annotations

from tests.fuzz.mutants import Mutant

# pytest subsets, by area (each a few seconds to a minute on the shared machine)
REDUCTIONS = ("tests/ops/test_reductions.py",)
SHAPE = ("tests/ops/test_shape.py",)
NN = ("tests/ops/test_nn.py",)
ELEMENTWISE = ("tests/ops/test_elementwise.py",)
AUTODIFF = ("tests/transforms/test_autodiff.py",)
GRAD_EDGES = ("tests/transforms/test_grad_edges.py",)
INPLACE = ("tests/tracer/test_inplace.py",)
GUARDS = ("tests/tracer/test_cache.py", "tests/tracer/test_guards_edges.py")
AUTOCAST = ("tests/tracer/test_autocast_ambient.py",)
LAYOUT = ("tests/tracer/test_layout.py", "tests/ops/test_strides.py")
CODEGEN = ("tests/executors/test_codegen.py", "tests/executors/test_codegen_numerics.py")
CODEGEN_MORE = ("tests/executors/test_codegen_edges.py", *CODEGEN)
CODEGEN_ROWS = ("tests/executors/test_codegen_rows.py",)
OBJECTS = ("tests/tracer/test_objects.py",)
FUSION = ("tests/transforms/test_fusion.py",)
REMAT = ("tests/transforms/test_remat.py",)
CSE = ("tests/transforms/test_pass_semantics.py", "tests/transforms/test_cse.py")
CREATION = ("tests/ops/test_creation.py",)
MODULES = ("tests/tracer/test_modules.py", "tests/tracer/test_module_behaviour.py")

MUTANTS: list[Mutant] = [
    # --- op decompositions (ops/torch) -------------------------------------------------------
    Mutant("ops_sub_as_add", "decomposition", "ops/torch/elementwise.py",
           '_scaled_binary("sub", prims.sub, input, other, alpha)',
           '_scaled_binary("sub", prims.add, input, other, alpha)', ELEMENTWISE),
    Mutant("ops_rsub_operands", "decomposition", "ops/torch/elementwise.py",
           '_scaled_binary("rsub", prims.sub, other, input, alpha)',
           '_scaled_binary("rsub", prims.sub, input, other, alpha)', ELEMENTWISE),
    Mutant("ops_keepdim_dropped", "decomposition", "ops/torch/reductions.py",
           "out = restore_dims(out, a.shape, dims) if keepdim else out",
           "out = out", REDUCTIONS),
    Mutant("ops_mean_count_off_by_one", "decomposition", "ops/torch/reductions.py",
           "count = math.prod(input.shape[d] for d in dims)\n    out = prims.div(",
           "count = max(math.prod(input.shape[d] for d in dims) - 1, 1)\n    out = prims.div(",
           REDUCTIONS),
    Mutant("ops_dim_wrap", "decomposition", "ops/torch/reductions.py",
           "wrapped = [d % bound for d in dims]",
           "wrapped = [d % bound if d >= 0 else d % bound - 1 for d in dims]", REDUCTIONS),
    Mutant("ops_split_start_not_advanced", "decomposition", "ops/torch/shape.py",
           "        pieces.append(slice_dim(a, dim, start, start + size))\n        start += size",
           "        pieces.append(slice_dim(a, dim, start, start + size))\n"
           "        start += size - 1 if size > 1 else size", SHAPE),
    Mutant("ops_narrow_off_by_one", "decomposition", "ops/torch/shape.py",
           "return slice_dim(input, dim, start, start + length)",
           "shift = int(start + length < size)\n"
           "    return slice_dim(input, dim, start + shift, start + length + shift)",
           SHAPE),
    Mutant("ops_getitem_step_size", "decomposition", "ops/torch/shape.py",
           "sizes = [(end - start + step - 1) // step",
           "sizes = [(end - start) // step", SHAPE),
    Mutant("ops_layer_norm_no_eps", "decomposition", "ops/torch/nn.py",
           "rstd = prims.rsqrt(prims.add(var, eps))", "rstd = prims.rsqrt(var)", NN),
    Mutant("ops_softmax_no_upcast", "dtype", "ops/torch/nn.py",
           "    x = to_dtype(a, compute_dtype(a.dtype))\n    top =",
           "    x = a\n    top =", ("tests/ops/test_half_precision.py", *NN)),
    Mutant("ops_softmax_log_sign", "decomposition", "ops/torch/nn.py",
           "out = prims.sub(shifted, prims.log(total))",
           "out = prims.add(shifted, prims.log(total))", NN),
    Mutant("ops_promotion_swapped", "dtype", "ops/torch/utils.py",
           "    return elementwise_dtypes(*args, type_promotion_kind=kind)",
           "    computation, result = elementwise_dtypes(*args, type_promotion_kind=kind)\n"
           "    return (result, computation) if result != computation else (computation, result)",
           ELEMENTWISE),
    Mutant("ops_reduction_half_no_upcast", "dtype", "ops/torch/reductions.py",
           "    if dtype in _HALF:\n        return torch.float32",
           "    if dtype in _HALF:\n        return dtype", REDUCTIONS),
    Mutant("ops_dropout_scale", "decomposition", "ops/torch/nn.py",
           "noise = prims.div(prims.bernoulli(tuple(a.shape), keep, a.dtype, a.device), keep)",
           "noise = prims.bernoulli(tuple(a.shape), keep, a.dtype, a.device)", AUTODIFF),
    # --- VJP rules (transforms/autodiff) -----------------------------------------------------
    Mutant("vjp_sub_sign", "vjp", "transforms/autodiff/rules.py",
           "_for_tensor(b, prims.neg(grad)) if", "_for_tensor(b, grad) if", AUTODIFF),
    Mutant("vjp_mul_swapped", "vjp", "transforms/autodiff/rules.py",
           "return (prims.mul(grad, b) if _is_tensor(a)",
           "return (prims.mul(grad, a) if _is_tensor(a)", AUTODIFF),
    Mutant("vjp_tanh_term", "vjp", "transforms/autodiff/rules.py",
           "_unary(prims.tanh, lambda a, out: prims.sub(1, _square(out)))",
           "_unary(prims.tanh, lambda a, out: prims.sub(1, out))", AUTODIFF),
    Mutant("vjp_permute_not_inverted", "vjp", "transforms/autodiff/rules_structural.py",
           "return prims.permute(grad, tuple(inverse)), None",
           "return prims.permute(grad, tuple(dims)), None", AUTODIFF),
    Mutant("vjp_linear_bias_none", "vjp", "transforms/autodiff/rules_structural.py",
           "grad_bias = None if bias is None else prims.sum(g2, (0,))",
           "grad_bias = None", AUTODIFF),
    Mutant("vjp_slice_pad_sides", "vjp", "transforms/autodiff/rules_structural.py",
           "config.append((start, size - last - 1, step - 1))",
           "config.append((size - last - 1, start, step - 1))", AUTODIFF),
    Mutant("vjp_layer_norm_term", "vjp", "transforms/autodiff/rules_composite.py",
           "prims.sub(prims.sub(g_hat, mean_g), prims.mul(x_hat, mean_gx))",
           "prims.sub(g_hat, mean_g)", AUTODIFF),
    Mutant("vjp_rms_weight_unnormalized", "vjp", "transforms/autodiff/rules_composite.py",
           "product = prims.mul(g, normalized)", "product = prims.mul(g, x)", AUTODIFF),
    Mutant("vjp_embedding_padding_kept", "vjp", "transforms/autodiff/rules_composite.py",
           "    if padding_idx is not None:\n        row = padding_idx",
           "    if False:\n        row = padding_idx", AUTODIFF),
    Mutant("vjp_convert_no_cast_back", "dtype", "transforms/autodiff/rules.py",
           "return prims.convert_element_type(grad, a.dtype), None", "return grad, None",
           ("tests/transforms/test_grad_dtypes.py", *AUTODIFF)),
    Mutant("vjp_max_ties_not_shared", "vjp", "transforms/autodiff/rules_structural.py",
           "return prims.mul(_unreduce(prims.div(grad, count), a, dims), hit), None",
           "return prims.mul(_unreduce(grad, a, dims), hit), None", AUTODIFF),
    # --- dtypes under autocast -------------------------------------------------------------
    Mutant("autocast_no_upcast", "dtype", "tracer/autocast.py",
           "casts = {name: dtype for name, dtype in with_autocast.items() if without.get(name) "
           "!= dtype}",
           "casts = {name: dtype for name, dtype in with_autocast.items() if without.get(name) "
           "!= dtype and dtype != torch.float32}",
           ("tests/tracer/test_autocast_casts.py", *AUTOCAST)),
    # --- layout (strides) ------------------------------------------------------------------
    Mutant("layout_permute_as_contiguous", "layout", "tracer/layout.py",
           "return [(leaf.shape, leaf.stride()) for leaf in outputs]  # the input's, permuted",
           "return [(leaf.shape, contiguous_strides(leaf.shape)) for leaf in outputs]", LAYOUT),
    Mutant("layout_elementwise_contiguous", "layout", "tracer/layout.py",
           "return [(outputs[0].shape, elementwise_strides(inputs, shape))]",
           "return [(outputs[0].shape, contiguous_strides(shape))]", LAYOUT),
    Mutant("layout_size0_stride", "layout", "proxies/tensor.py",
           "        acc *= max(size, 1)", "        acc *= size",
           ("tests/tracer/test_layout_degenerate.py", *LAYOUT)),
    # --- in-place updates / mutation -------------------------------------------------------
    Mutant("mutation_writeback_dropped", "mutation", "tracer/mutation.py",
           "            self.ctx.bsyms.append(BoundSymbol(WRITE_BACK, (root.proxy, root.value)",
           "            if root.proxy.requires_grad:\n"
           "                self.ctx.bsyms.append(BoundSymbol(WRITE_BACK, (root.proxy, root.value)",
           INPLACE),
    Mutant("mutation_view_scatter_dropped", "mutation", "ops/functionalized.py",
           "    view.copy_(value)\n    return out", "    return out", INPLACE),
    Mutant("bn_running_var_dropped", "mutation", "tracer/mutation.py",
           "for target, stat in ((running_mean, mean), (running_var, var)):",
           "for target, stat in ((running_mean, mean),):", INPLACE),
    Mutant("bn_running_var_biased", "mutation", "tracer/mutation.py",
           "var = detached.var(dims, correction=1 if count > 1 else 0)",
           "var = detached.var(dims, correction=0)", INPLACE),
    Mutant("objects_new_state_entry_dropped", "mutation", "tracer/objects.py",
           "                if isinstance(key, TensorProxy):  # a new entry keyed by an input "
           "tensor\n                    key = real[key.name]",
           "                if isinstance(key, TensorProxy):  # a new entry keyed by an input "
           "tensor\n                    continue", OBJECTS),
    # --- codegen kernels ---------------------------------------------------------------------
    Mutant("codegen_sub_spelled_add", "codegen", "executors/codegen/ops.py",
           '_op("sub", 2, NUMERIC, "({a} - {b})", "({a} - {b})")',
           '_op("sub", 2, NUMERIC, "({a} + {b})", "({a} - {b})")', CODEGEN),
    Mutant("codegen_ge_spelled_gt", "codegen", "executors/codegen/ops.py",
           '"gt": ">", "ge": ">="}', '"gt": ">", "ge": ">"}', CODEGEN_MORE),
    Mutant("codegen_pow_m2_precedence", "codegen", "executors/codegen/ops.py",
           '-2.0: "({one} / ({a} * {a}))"', '-2.0: "({one} / {a} * {a})"', CODEGEN_MORE),
    Mutant("codegen_sum_init_one", "codegen", "executors/codegen/cpu/rows.py",
           'init, op = ("0", "+") if red.name == "sum" else ("1", "*")',
           'init, op = ("1", "+") if red.name == "sum" else ("1", "*")', CODEGEN_ROWS),
    Mutant("codegen_max_block_combine", "codegen", "executors/codegen/cpu/rows.py",
           'f"a{v} = b{v} {cmp} a{v} ? b{v} : a{v};"', 'f"a{v} = b{v};"', CODEGEN_ROWS),
    Mutant("codegen_int_amin_init", "codegen", "executors/codegen/cpu/rows.py",
           "{'lowest' if is_max else 'max'}()", "{'lowest' if is_max else 'min'}()",
           CODEGEN_ROWS),
    Mutant("codegen_var_correction", "codegen", "executors/codegen/rows.py",
           "Const(float(correction), f64)", "Const(0.0, f64)", CODEGEN_ROWS),
    Mutant("codegen_half_not_rounded", "dtype", "executors/codegen/cpu/target.py",
           'rounds = {torch.bfloat16: "bf16_round({})", torch.float16: "f16_round({})"}',
           "rounds = {}", CODEGEN),
    Mutant("codegen_strided_index_odd_pointer", "codegen", "executors/codegen/target.py",
           'return {0: "0", 1: "j"}.get(kind, f"j * s{p}")',
           'return {0: "0", 1: "j"}.get(kind, f"j * s{p} + {p} % 2")', CODEGEN_MORE),
    Mutant("codegen_slice_offset_unscaled", "codegen", "executors/codegen/region.py",
           "offset += start * strides[d]", "offset += start", CODEGEN_MORE),
    Mutant("codegen_flip_offset", "codegen", "executors/codegen/region.py",
           "offset += (sizes[d] - 1) * strides[d]", "offset += sizes[d] * strides[d] - 1",
           CODEGEN_MORE),
    Mutant("codegen_size1_broadcast_stride", "codegen", "executors/codegen/region.py",
           "new[d] = strides[i] if sizes[i] != 1 else 0", "new[d] = strides[i]", CODEGEN),
    Mutant("codegen_inner_stride_off_by_one", "codegen", "executors/codegen/cpu/render.py",
           "strides[{p} * ndim + ndim - 1]", "strides[{p} * ndim + ndim - 2]", CODEGEN),
    # --- guards (cache keys) -------------------------------------------------------------------
    Mutant("guard_requires_grad", "guards", "tracer/guards.py",
           "return (t.shape, t.dtype, t.device, t.requires_grad, t.stride())",
           "return (t.shape, t.dtype, t.device, t.stride())", GUARDS),
    Mutant("guard_dtype", "guards", "tracer/guards.py",
           "return (t.shape, t.dtype, t.device, t.requires_grad, t.stride())",
           "return (t.shape, t.device, t.requires_grad, t.stride())", GUARDS),
    Mutant("guard_strides", "guards", "tracer/guards.py",
           "return (t.shape, t.dtype, t.device, t.requires_grad, t.stride())",
           "return (t.shape, t.dtype, t.device, t.requires_grad, t.is_contiguous())",
           ("tests/tracer/test_guard_behaviour.py", *GUARDS)),
    Mutant("guard_grad_mode", "guards", "tracer/guards.py",
           "            _is_grad_enabled(),\n", "", GUARDS),
    Mutant("guard_training_flag", "guards", "tracer/guards.py",
           "tuple(map(_training, self.modules)) if self.modules else (),",
           "(),", MODULES),
    Mutant("guard_autocast_dtype", "guards", "tracer/guards.py",
           "_any_autocast() and autocast_key(),", "_any_autocast(),", AUTOCAST),
    Mutant("guard_symbolic_requires_grad", "guards", "tracer/guards.py",
           'return ("symbolic", tuple(shape), t.dtype, t.device, t.requires_grad,',
           'return ("symbolic", tuple(shape), t.dtype, t.device, None,',
           ("tests/tracer/test_guard_behaviour.py", "tests/tracer/test_dynamic_shapes.py")),
    # --- autograd bridge -----------------------------------------------------------------------
    Mutant("bridge_first_grad_dropped", "bridge", "autograd_bridge.py",
           "return (None, *input_grads)",
           "return (None, None, *input_grads[1:])", AUTODIFF),
    Mutant("bridge_outputs_detached", "bridge", "autograd_bridge.py",
           "if not flag and isinstance(out, torch.Tensor)", "if isinstance(out, torch.Tensor)",
           AUTODIFF),
    # --- passes --------------------------------------------------------------------------------
    Mutant("dce_drops_side_effects", "passes", "transforms/dce.py",
           "if bsym.has_side_effects or live & bsym.output_names:",
           "if live & bsym.output_names:", INPLACE),
    Mutant("deletion_one_early", "passes", "transforms/deletion.py",
           "        bsyms.append(bsym)\n        if dead:\n"
           "            bsyms.append(BoundSymbol(DEL, tuple(dead), source=bsym.source))",
           "        if dead and len(dead) > 1:\n"
           "            bsyms.append(BoundSymbol(DEL, tuple(dead[1:]), source=bsym.source))\n"
           "        bsyms.append(bsym)\n        if dead:\n"
           "            bsyms.append(BoundSymbol(DEL, tuple(dead[:1]), source=bsym.source))",
           ("tests/transforms/test_memory.py", "tests/core/test_trace.py")),
    Mutant("remat_recomputes_random", "passes", "transforms/remat.py",
           'if bsym.has_side_effects or "opaque" in bsym.sym.tags:',
           'if "opaque" in bsym.sym.tags or bsym.sym.name == "copy_":',
           ("tests/transforms/test_pass_semantics.py", *REMAT)),
    Mutant("fusion_order_reversed", "passes", "transforms/fusion.py",
           "key=lambda r: r))", "key=lambda r: -r))",
           ("tests/transforms/test_pass_semantics.py", *FUSION)),
    Mutant("cse_merges_random", "passes", "transforms/cse.py",
           'if bsym.has_side_effects or "opaque" in bsym.sym.tags or not bsym.proxy_outputs:',
           'if "opaque" in bsym.sym.tags or not bsym.proxy_outputs:', CSE),
    Mutant("cse_key_without_kwargs", "passes", "transforms/cse.py",
           "return id(bsym.sym), _key(bsym.args), _key(bsym.kwargs)",
           "return id(bsym.sym), _key(bsym.args)", CSE),
    # --- second round: prim implementations, gradient accumulation, no_grad, plan cache ------
    Mutant("autodiff_accumulate_dropped", "vjp", "transforms/autodiff/rules.py",
           "return grad if existing is None else prims.add(existing, grad)", "return grad",
           AUTODIFF),
    Mutant("relu_grad_tie_passes", "vjp", "transforms/autodiff/rules_edges.py",
           "return prims.where(prims.le(out, 0), 0.0, grad)",
           "return prims.where(prims.lt(out, 0), 0.0, grad)", GRAD_EDGES),
    Mutant("no_grad_not_detached", "bridge", "tracer/dispatch.py",
           "detached = {p.name: T.detach(p) for p in floating}", "detached = {}", MODULES),
    Mutant("prim_pad_sides_swapped", "decomposition", "executors/torch/prims.py",
           "flat += [low, high]", "flat += [high, low]", AUTODIFF),
    Mutant("prim_iota_formula", "decomposition", "executors/torch/prims.py",
           "(torch.arange(length, dtype=wide, device=device) * step + start)",
           "((torch.arange(length, dtype=wide, device=device) + start) * step)", CREATION),
    # --- third round: the CPU prelude's helpers (C++) --------------------------------------
    Mutant("codegen_bf16_ties_round_up", "dtype", "executors/codegen/include/cpu.h",
           "u += 0x7fffu + ((u >> 16) & 1u);", "u += 0x8000u;", CODEGEN_MORE),
    Mutant("codegen_sign_of_zero", "codegen", "executors/codegen/include/cpu.h",
           "return (T)((T(0) < a) - (a < T(0)));", "return (T)((T(0) < a) - (a <= T(0)));",
           CODEGEN_MORE),
    Mutant("codegen_max_drops_nan", "codegen", "executors/codegen/include/cpu.h",
           "return (a >= b || a != a) ? a : b;", "return (a >= b) ? a : b;", CODEGEN_MORE),
    Mutant("codegen_remainder_sign", "codegen", "executors/codegen/include/cpu.h",
           "if (m != 0 && ((b < 0) != (m < 0))) m += b;",
           "if (m != 0 && (b < 0)) m += b;", CODEGEN_MORE),
]
