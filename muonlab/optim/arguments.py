"""Muon's arguments beyond the group hyperparameters, each in full: ``ARGS``, which ends
``Muon``'s docstring (``help(Muon)``, ``Muon.__doc__``)."""

ARGS = """
    Args beyond the hyperparameters:
        ns_dtype: Newton-Schulz compute dtype. "auto": bf16 on CUDA (like torch.optim.Muon), and on
            a CPU bf16 only with native bf16 matmul and for matrices above
            ``muonlab.kernels.newton_schulz.CPU_FP32_MAX_WORK``, else fp32 (emulated bf16 runs at a
            third of fp32's rate; small products are faster in fp32); or a dtype (fp32 for tight
            parity).
        ns_form: "plain", "gram" (fewer FLOPs on rectangular matrices, see newton_schulz; its
            iterates are fp16 where the device multiplies fp16 natively, else fp32, never bf16) or
            "auto": the gram form where it saves at least 20% of the FLOPs and its iterates are no
            wider than ns_dtype (on a CPU without fp16 matmul, a 16-bit ns_dtype keeps the plain
            form), the plain form elsewhere; its error stays within 1.5x of the plain form's (see
            muonlab.kernels.newton_schulz.AUTO_GRAM_SAVING for the time and accuracy measured).
            "plain" computes torch.optim.Muon's iteration; matrix by matrix it keeps torch's bits
            where bf16 matmul is native (an emulated one, on an AVX2-only CPU, rounds by the
            operands' layout, and a tall matrix iterates as stored here, transposed in torch), but
            batched products may round differently (last-bit differences that grow over a
            run). In the update itself: tall bf16
            parameters (rows > cols) may differ in the last bf16 bit: torch adds its update as a
            transposed view, muonlab as a contiguous tensor, and torch's bf16 ``add_`` rounds the
            two layouts differently. A tensor lr (torch's capturable form: one element, on the
            parameters' device or the CPU) stays a tensor: the step reads it on the device, where a
            scheduler fills it in place, with no host read; each update is multiplied by it in fp32
            and the decay is p + p * (-lr * weight_decay), so the bits differ from a float lr's
            (last-bit differences; the same holds for AdamW groups, whose bias corrections then
            run on the device too). Its value is checked when a new tensor is set, not after
            each fill (muonlab.optim.prepared.TensorSetting). And one difference that is
            torch's: with bf16 parameters and ``nesterov=False`` torch.optim.Muon (2.13) hands its
            momentum buffer itself to its Newton-Schulz, which divides it by its norm in place;
            muonlab's buffer follows the documented recurrence.
        ns_backend: "auto" (per shape, torch or Triton, whichever was measured faster on this
            device; see muonlab.kernels.backend_choice), "torch" or "triton".
        momentum_dtype: dtype of Muon's momentum buffers. None (default): the parameter's dtype, as
            torch.optim.Muon keeps it: for bf16 parameters 2 bytes per element, and the momentum
            accumulates in bf16 (an EMA step smaller than bf16's resolution of the buffer is lost).
            torch.float32: 4 bytes per element (twice the state memory of bf16 parameters, the same
            for fp32 ones), every small gradient contribution kept; the Newton-Schulz input is cast
            from it.
        workspace_bytes: the most transient memory one Newton-Schulz call may take (its inputs,
            iterates and output). A batch of same-shape matrices that needs more runs in chunks
            that fit, into one reused workspace; None: max(256 MiB on a GPU or 8 MiB on a CPU, 5% of
            a rank's even share of the Muon parameter bytes). Must be the same on every rank (it
            shapes the plan; checked). An expert bank with more matrices on a rank than
            fit runs in parts (``BatchPlan.part``: momentum, Newton-Schulz and update a part at a
            time), so its momentum inputs are never all alive at once either; replicated (DDP)
            matrices run in batches whose all-gather, which every rank receives, holds about as
            many matrices as fit. Smaller saves memory; too small (below one matrix) runs one
            matrix at a time.
        ns_graphs: on CUDA, capture each chunk shape's Newton-Schulz chain in a CUDA graph once
            and replay it (one launch per chunk instead of three per iteration: faster below
            width ~4096, where eager launches leave the GPU idle). Costs the static buffers of
            one chunk per distinct chunk shape, held between steps. Ignored on CPU.
        process_group: the group replicated (plain-tensor, DDP) parameters are divided over;
            default: the default group when torch.distributed runs with more than one rank.
            DTensor parameters always use their own mesh. Replicas must hold equal weights and
            equal (DDP-averaged) gradients; both are compared when a plan is made, the gradients
            also at every step (see muonlab.optim.replicas). For a model per rank, each trained on its
            own data, give each rank a group of its own (``dist.new_group([rank])``).
        comm_dtype: dtype of matrices on the wire. "auto" (default): per batch, the dtype its
            Newton-Schulz computes in (bf16 where that is bf16, fp32 otherwise: a bf16 wire
            under fp32 iterates rounds away what the iteration lifts, see muonlab.comm.wire), so
            a distributed step equals one process; ``plan()`` gives each batch's
            (``BatchPlan.comm_itemsize``). torch.bfloat16: every batch in bf16 (half an fp32
            batch's bytes, with that rounding); torch.float32: every batch in fp32. Not fp16:
            momentum travels before it is normalised, and fp16's range can't hold it.
        remainder_path: "auto", "all_to_all" or "agrs" for row-sharded batches of fewer than W
            matrices; "auto" takes the lower modelled time under ``hardware_profile``.
        hardware_profile: a muonlab.comm.cost profile name or HardwareProfile (default:
            "h100_node" with CUDA, else "cpu_gloo").
        fused_banks: {parameter name: E} for 2-D parameters that stack E matrices on dim 0 (a
            fused expert bank (E*M, N), a fused QKV per head); each is orthogonalized as E separate
            matrices. Added to those ``muon_param_groups(split_heads=...)`` declared.
        matrix_views: {parameter name: "matrix" | "transpose" | "flatten" | "bank"} for Muon
            parameters whose view differs from their shape's default, e.g. "transpose" for a 2-D
            weight stored (in, out): orthogonalized as stored, its lr ratio reads (out, in).
            Overrides the views ``muon_param_groups`` declared.
        nonfinite: an inf or NaN in any gradient on any rank makes every rank "skip" the step
            (decided together by one exchange of per-rank flags; parameters and state untouched,
            counted in ``skipped_steps`` and ``last_step_stats()``), "raise" a ValueError naming
            the parameter and rank, or is "ignore"d. The flags travel in the step's one control
            exchange with the ranks' agreement digest, before anything is written or moved
            (see muonlab.optim.nonfinite); on a GPU reading this rank's flag synchronises once per step.
        nonfinite_decision: where "skip" is decided: "host" (above: a skipped step runs nothing)
            or "device" (nothing read: the flags are added on the device in one all-reduce of W
            numbers on the step's group, the step runs whole and writes only if no rank
            flagged, bit for bit as "host" otherwise; ``skipped_steps`` and the stats read the
            decision when asked; see muonlab.optim.step_gate). "device" needs nonfinite="skip".
        strategy: "muonlab" (the planner) or "redundant" (every rank gathers and orthogonalizes
            every matrix: the baseline, for benchmarks and parity).
        state_offload: None (state on the parameters' device), "cpu" (momentum and AdamW moments
            of this rank's shards in host memory, pinned with CUDA) or "disk" (in one
            memory-mapped file per rank under ``offload_dir``). The step fetches one parameter's
            state at a time onto the device, the next one's meanwhile, and writes it back after
            its update: results are bit-identical to state_offload=None (see muonlab.optim.offload).
            With "disk" the optimizer can't be copied or pickled, nor take new parameter groups.
        offload_dir: the directory of the "disk" state file (required for "disk"; locked per rank).
        keep_muon_momentum_in_memory: offload only the AdamW moments; Muon momentum stays resident.
        update_rule: what happens between a matrix's orthogonalized update and its parameter, per
            group (a key of ``muonlab.optim.rules.RULES``): "muon" (the update as it is) or
            "normuon" (NorMuon, Li et al. 2025: per-row second moments, decay ``normuon_beta2``,
            normalise the update, then rescaled to the norm ``normuon_scale`` picks; see
            muonlab.optim.rules.normuon). NorMuon keeps one fp32 number per row of each matrix
            (state key "row_variance", with the rows: on their FSDP2 shard, with an expert, on
            every DDP replica; on the parameters' device under ``state_offload``). A batch of
            matrices whose rows lie on several ranks adds one all-reduce of two numbers per
            matrix, which travels while the next batch computes (the batch is applied then; see
            muonlab.optim.rule_step). A matrix stored (in, out) (view "transpose") keeps one
            number per stored column (its neurons) and is normalised by column; where its rows are
            sharded its column sums travel instead (out numbers per matrix) and that state is
            replicated over the ranks holding the rows. Refused for shards on a dim other than 0.
        normuon_beta2: NorMuon's decay of the row second moments, in [0, 1).
        normuon_scale: the Frobenius norm NorMuon rescales its normalised update to: "code" (the
            orthogonalized update's own, as the authors' code) or "paper" (an orthogonal matrix's,
            sqrt(min(m, n)): with adjust_lr="match_rms_adamw" and nesterov=False, the paper's
            Algorithm 1); see muonlab.optim.rules.normuon.
        capture_after: None, or N >= 1: on CUDA, the hot step runs eagerly N times with the same
            prepared step, settings and tensors, is then captured whole in a CUDA graph
            (collectives included, on NCCL) and replayed at every later step; the host part
            (validation when something changed, the ranks' agreement) still runs before each
            replay (muonlab.optim.step_graph). Needs nonfinite_decision="device" (or
            nonfinite="ignore"), ns_graphs=False, no state_offload, CUDA parameters, and
            gradients kept in place (``zero_grad(set_to_none=False)``); a scheduler's lr should
            be a tensor on the parameters' device (a float lr that changes keeps the step eager).
            A replayed step records no spans; its stats keep bytes and the skip, not seconds
            (``trace_next_step()`` runs the next step eagerly, with its spans, keeping the graph).
"""
