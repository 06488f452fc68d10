"""The invariant catalogue: every rule refspec checks has a permanent ID, a level and sources.

IDs are grouped by family: ``PA-`` paging and attention (the FA3 kernel contract), ``KV-``
KV-cache accounting, ``MD-`` attention metadata per forward mode, ``CG-`` CUDA-graph capture and
replay, ``SD-`` the speculative-decoding loop, ``TR-`` top-k > 1 trees, ``ML-`` multi-head latent
attention (MLA: DeepSeek's latent KV row, its views and the ``qv`` kernel call), ``TOL-`` tolerance
tiers.

:data:`RULES` holds one :class:`~refspec.core.sources.Rule` per ID: the one-line title, the
conformance level (kernel contract / upstream behaviour / refspec hardening), the upstream
sources as links, the SGLang versions the rule matches and the pins at which
``python -m refspec conformance`` compares it.  :data:`INVARIANTS` is the ``ID -> title`` view
that most modules import.  ``docs/spec/*.md`` states each rule in full (``python -m refspec
cite ID`` prints one), ``docs/versions.md`` is the version table, and ``tests/test_spec_ids.py``
checks that docs, code and tests agree.
"""

from __future__ import annotations

from refspec.core.sources import V_LAST_V1 as OLD
from refspec.core.sources import V_LATEST as NEW
from refspec.core.sources import V_OLDEST as V55
from refspec.core.sources import Level, Rule, commit, doc, external, fa3, pr, sgl

K, U, H = Level.KERNEL, Level.UPSTREAM, Level.HARDENING
FA3B = "srt/layers/attention/flashattention_backend.py"
ALLOC = "srt/mem_cache/allocator.py"
BOTH = (OLD, NEW)  # the two conformance pins
ALL = (V55, OLD, NEW)
FACTS = "kernel-facts.md"


# the files docs/spec/tree.md cites (lines read from the release wheels)
SPEC_UTILS, EAGLE_UTILS = "srt/speculative/spec_utils.py", "srt/speculative/eagle_utils.py"
SPEC_TREE, EAGLE_WORKER = "kernels/ops/speculative/spec_tree.py", "srt/speculative/eagle_worker.py"
EWC = "srt/speculative/eagle_worker_common.py"

# the files docs/spec/mla.md cites (lines read from the release wheels)
MP = "srt/mem_cache/memory_pool.py"
DH = "srt/models/deepseek_common/attention_backend_handler.py"
FWD_MLA = "srt/models/deepseek_common/attention_forward_methods/forward_mla.py"
FWD_MHA = "srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
DSV2 = "srt/models/deepseek_v2.py"
MLA_PAGE = "mla.md"

#: the MLA verify-cascade defect (ML-011): run at both pins, reachable at v0.5.23
MLA_VERIFY_EXPAND = ("v0.5.12.post1 and v0.5.23: the MLA branch of forward_extend passes the P-paged views "
                     "(k_rope_cache, c_kv_cache) to the TARGET_VERIFY expand call, whose table holds token slots, "
                     "where the MHA branch passes paged_view(., 1) (sglang#7725); at P > 1 with top-k > 1 a verify "
                     "row then reads page `slot` (another request's rows, or past the pool) instead of its own slot. "
                     "Run, not read: python -m refspec conformance drives upstream's own MLA forward and shows it as "
                     "the known upstream bug mla-verify-expand-paged-view at both pins (mla_tree_verify, P >= 4). "
                     "Reachable at v0.5.23 (its guard lets fa3 run top-k > 1 with P > 1: "
                     "arg_groups/speculative_hook.py L1271-1283; no MLA guard); at v0.5.12.post1 the configuration "
                     "passes server_args.py L3837-3844 but no round survives ML-012's missing move_kv_cache "
                     "(sglang#26982), so the wrong verify output is never committed there (docs/mla.md)")


#: the one context-wall defect (CG-008 and PA-003: one level, cross-referenced)
CONTEXT_WALL = ("at the context wall: v0.5.5 to v0.5.23 size the CUDA-graph page tables "
                 "ceil(context_len / P), below the kernel bound ceil((context_len + N) / P), so a request near the "
                 "limit replays without its last live page (context 64, P = 16, L = 61: K = 65 needs 5 pages, the table has 4; "
                 "python -m refspec conformance shows it as the known upstream bug context-wall-page-table at "
                 "v0.5.12.post1 and v0.5.23). Open fix: sglang#35985 (#29665, the same change, was closed). One "
                 "defect: CG-008 is the graph-buffer form of PA-003")


def _fb(line: int, symbol: str, version: str = V55):
    return sgl(FA3B, version, line, symbol)


RULES: dict[str, Rule] = {
    # --- paging / attention ------------------------------------------------------------
    "PA-001": Rule("req_to_token rows are page-contiguous (INV-PAGE)", U,
                   (sgl(ALLOC, V55, 470, "PagedTokenToKVPoolAllocator.alloc_extend"),), (V55, OLD)),
    "PA-002": Rule("page_table[b, p // P] * P + p % P == req_to_token[r_b, p] for every p < K_b", U,
                   (_fb(645, "FlashAttentionBackend.init_forward_metadata"), commit("188f0955f", 5318),
                    pr(5090, "pre-fix")), ALL, BOTH),
    "PA-003": Rule("page_table has at least ceil(K_b / P) columns for every request", K,
                   (fa3("flash_api.cpp", 768, "mha_fwd"), doc(FACTS, "page-table-columns"),
                    external("sglang#35985", "https://github.com/sgl-project/sglang/pull/35985")),
                   violated_by=CONTEXT_WALL),
    "PA-004": Rule("bottom-right causal: query row i of request b sees key p iff p <= i + K_b - q_b", K,
                   (fa3("flash_attn_interface.py", 998, "flash_attn_with_kvcache"), doc(FACTS, "measured-semantics"))),
    "PA-005": Rule("a query row with no visible key outputs exactly 0", K, (doc(FACTS, "measured-semantics"),)),
    "PA-006": Rule("GQA: query head h reads KV head h // (H / Hkv)", K,
                   (fa3("flash_api.cpp", 781, "mha_fwd"), doc(FACTS, "measured-semantics"))),
    "PA-007": Rule("the kernel reads no page-table column >= ceil(K_b / P) and no key >= K_b", K,
                   (doc(FACTS, "page-table-columns"),)),
    "PA-008": Rule("page 0 and req_to_token row 0 are reserved dummies, never given to a request", U,
                   (sgl(ALLOC, V55, 567, "PagedTokenToKVPoolAllocator.clear"),
                    sgl("srt/mem_cache/memory_pool.py", NEW, 409, "ReqToTokenPool.__init__")), (OLD, NEW)),
    "PA-009": Rule("store-then-attend: new K/V are written at out_cache_loc before the kernel runs", U,
                   (_fb(672, "FlashAttentionBackend.forward_extend"), _fb(989, "FlashAttentionBackend.forward_decode")),
                   ALL),
    "PA-010": Rule("every request's query length fits max_seqlen_q", K,
                   (fa3("flash_api.cpp", 745, "mha_fwd"), doc(FACTS, "max-seqlen-q"))),
    "PA-011": Rule("kernel arguments are well formed (dtypes, shapes, page ids in the pool)", K,
                   (fa3("flash_api.cpp", 735, "mha_fwd"), fa3("flash_api.cpp", 744, "mha_fwd"))),
    "PA-012": Rule("the attention call passes the layer's constants: softmax_scale, softcap, window_size; num_splits "
                   "0 (the kernel's choice)", U,
                   (_fb(2285, "FlashAttentionBackend.forward_decode", NEW),
                    _fb(1789, "FlashAttentionBackend.forward_extend", NEW)), BOTH, BOTH),
    "PA-013": Rule("a precomputed scheduler_metadata is computed from its own call's batch, lengths, heads, page size "
                   "and flags (rewritten before every replay)", K,
                   (fa3("flash_api.cpp", 1004, "mha_fwd"), fa3("flash_api.cpp", 522, "mha_fwd_get_scheduler_metadata"),
                    _fb(409, "FlashAttentionBackend._compute_scheduler_metadata", NEW), pr(21104, "the precompute"))),
    # --- KV accounting -----------------------------------------------------------------
    "KV-001": Rule("alloc_extend continues the request's last partial page (INV-PAGE is kept)", U,
                   (sgl(ALLOC, V55, 459, "PagedTokenToKVPoolAllocator.alloc_extend"),), (V55, OLD)),
    "KV-002": Rule("free is page-granular and the free-page count is exact", U,
                   (sgl(ALLOC, V55, 556, "PagedTokenToKVPoolAllocator.free"),), (V55, OLD)),
    "KV-003": Rule("exhaustion, double free and freeing reserved pages raise", H,
                   (sgl(ALLOC, V55, 551, "PagedTokenToKVPoolAllocator.free"),),
                   upstream="alloc_extend returns None when pages run out; a double free is caught only in debug_mode"),
    "KV-004": Rule("v1 rejected slots: keep the page holding the last committed token, free whole pages after it", U,
                   (sgl("srt/speculative/spec_utils.py", V55, 300, "align_evict_mask_to_page_size"),), (V55, OLD)),
    "KV-005": Rule("v2 over-allocation: allocate_len = seq_len + N before a round (overlap: ceil((L + 2N) / P) * P), "
                   "nothing freed inside it", U,
                   (sgl("srt/speculative/eagle_worker_v2.py", V55, 91, "EagleDraftInput.ALLOC_LEN_PER_DECODE"),
                    pr(11772, "page-aware"), pr(13478, "CPU-side 2 x ALLOC reserve, mem_cache/allocation_sizing.py")),
                   (V55,), upstream="the overlap reserve is upstream's CPU-side allocation since #13478"),
    "KV-006": Rule("when every request has finished, the free-page count returns to its start", U,
                   (sgl(ALLOC, V55, 567, "PagedTokenToKVPoolAllocator.clear"),), (V55, OLD)),
    "KV-007": Rule("the allocator's host mirror of req_to_token equals the device req_to_token", H,
                   (pr(13478, "allocation lengths kept on the host"), doc("spec/kv.md", "kv-007")),
                   upstream="SGLang keeps the lengths it allocates from on the host (Req.kv_allocated_len, "
                            "kv_committed_len), not a host copy of req_to_token"),
    # --- metadata per mode ---------------------------------------------------------------
    "MD-001": Rule("all metadata tensors are int32 and contiguous", K,
                   (fa3("flash_api.cpp", 735, "mha_fwd"), fa3("flash_api.cpp", 744, "mha_fwd"))),
    "MD-002": Rule("cu_seqlens_q starts at 0, is non-decreasing and gives the mode's q_b", U,
                   (_fb(365, "FlashAttentionBackend.init_forward_metadata"),
                    _fb(890, "FlashAttentionBackend.init_forward_metadata", NEW)), ALL, BOTH),
    "MD-003": Rule("cache_seqlens K_b equals the mode's formula (L; L + s + 1; L + N; extend and draft extend: seq_lens)", U,
                   (_fb(365, "FlashAttentionBackend.init_forward_metadata"),
                    _fb(890, "FlashAttentionBackend.init_forward_metadata", NEW)), ALL, BOTH),
    "MD-004": Rule("K_b >= q_b for every real request", U,
                   (_fb(365, "FlashAttentionBackend.init_forward_metadata"),), ALL, BOTH),
    "MD-005": Rule("INV-TAIL: out_cache_loc[cu_q[b] + i] == req_to_token[r_b, K_b - q_b + i]", U,
                   (_fb(672, "FlashAttentionBackend.forward_extend"), pr(26512, "broke it; reverted by #26628")), ALL),
    "MD-006": Rule("cu_seqlens_k = [0, cumsum K]; max_seqlen_k comes from the CPU mirror (overlap: an upper bound)", U,
                   (_fb(365, "FlashAttentionBackend.init_forward_metadata"), doc("versions.md", "documented-differences"),
                    pr(25879, "seq_lens through the FutureMap; FA3 needs_cpu_seq_lens = False")),
                   ALL, BOTH),
    "MD-007": Rule("page_table = req_to_token[r, ::P] // P over ceil(max K / P) columns", U,
                   (_fb(645, "FlashAttentionBackend.init_forward_metadata"),
                    sgl("kernels/ops/attention/metadata.py", NEW, 505, "normal_decode_set_metadata")), ALL, BOTH),
    "MD-008": Rule("DRAFT_EXTEND_V2: K_b = seq_lens (= L + N); extend_seq_lens is never added again", U,
                   (sgl("srt/speculative/eagle_info_v2.py", V55, 179, "EagleDraftInputV2Mixin.prepare_for_extend_to_fill_draft_kvcache"),
                    pr(26512, "double count"), pr(26628, "revert"), pr(26651, "fixture fix")), ALL, BOTH),
    "MD-009": Rule("DRAFT_EXTEND (v1): q_b = num_accept_tokens = n + 1, packed", U,
                   (sgl("srt/speculative/eagle_info.py", V55, 674, "EagleDraftInput.prepare_extend_after_decode"),
                    pr(23962, "rename"), pr(25014, "rename")), (V55, OLD), (OLD,)),
    "MD-010": Rule("draft decode step s: q_b = 1, K_b = L_b + s + 1", U,
                   (_fb(372, "FlashAttentionBackend.init_forward_metadata"),
                    sgl(FA3B, NEW, 3477, "FlashAttentionMultiStepBackend")), ALL, BOTH),
    "MD-011": Rule("TARGET_VERIFY: q_b = N, K_b = L_b + N", U,
                   (_fb(460, "FlashAttentionBackend.init_forward_metadata"),), ALL, BOTH),
    "MD-012": Rule("the real requests of a batch have distinct req_to_token rows and write distinct slots", U,
                   (sgl("srt/mem_cache/memory_pool.py", V55, 110, "ReqToTokenPool.alloc"),), (V55, OLD)),
    # --- CUDA graphs ---------------------------------------------------------------------
    "CG-001": Rule("replay writes captured buffers in place and never rebinds them (address stability)", U,
                   (commit("6ffb6bd47", 4855), _fb(1731, "FlashAttentionBackend.init_forward_metadata_replay_cuda_graph"),
                    sgl(FA3B, NEW, 2953, "FlashAttentionBackend._set_decode_page_metadata"),
                    pr(26019, "closed; its review found replay rebuilding the captured metadata")), ALL),
    "CG-002": Rule("replay equals eager on real rows (metadata T0; outputs T0 on the emulator, T1 on the H200)", U,
                   (_fb(1731, "FlashAttentionBackend.init_forward_metadata_replay_cuda_graph"),
                    doc(FACTS, "split-kv-and-graph-replay")), ALL, BOTH),
    "CG-003": Rule("DRAFT_EXTEND (v1) replay: cu_seqlens_q = [0, cumsum(num_accept_tokens)]", U,
                   (_fb(1951, "FlashAttentionBackend.init_forward_metadata_replay_cuda_graph"),
                    sgl(FA3B, OLD, 2165, "FlashAttentionBackend.init_forward_metadata_replay_cuda_graph"),
                    commit("631950280", 6606), commit("376dfb03f", 19807)), (V55, OLD), (OLD,)),
    "CG-004": Rule("DRAFT_EXTEND_V2 replay: cu_seqlens_q = [0, W, 2W, ..., Bg*W] from extend_seq_lens", U,
                   (sgl(FA3B, OLD, 2191, "FlashAttentionBackend.init_forward_metadata_replay_cuda_graph"),
                    sgl("kernels/ops/attention/metadata.py", NEW, 417, "draft_extend_set_metadata"),
                    commit("160a06cab", 15207), pr(21987), pr(25002)), BOTH, BOTH),
    "CG-005": Rule("padded rows get the fills (seq_lens 1, out_cache_loc 0, req_pool_indices 0), rewritten every replay", H,
                   (sgl("srt/model_executor/cuda_graph_runner.py", V55, 758, "CudaGraphRunner.replay_prepare"),
                    sgl("srt/model_executor/cuda_graph_runner.py", OLD, 296, "DecodeInputBuffers.populate_from_forward_batch"),
                    sgl("srt/speculative/eagle_draft_cuda_graph_runner.py", OLD, 424, "EAGLEDraftCudaGraphRunner.replay"),
                    sgl("srt/speculative/eagle_draft_extend_cuda_graph_runner.py", NEW, 541,
                        "EAGLEDraftExtendCudaGraphRunner.execute"),
                    commit("c64290dcb", 7233)),
                   upstream=("seq_lens fill 1 and out_cache_loc 0 as refspec; padded req_pool_indices stay stale in every "
                             "runner at v0.5.5 and in the target and draft-extend runners at v0.5.12.post1 (zeroed by the "
                             "draft-decode runner); v0.5.23 zeroes them in all three; the draft-extend seq_lens fill is 1, "
                             "refspec's is W")),
    "CG-006": Rule("captured max_seqlen_q is the mode's bound (1, N, Sd+1) and covers every live query", U,
                   (_fb(1496, "FlashAttentionBackend.init_forward_metadata_capture_cuda_graph"),
                    external("transformers#45323", "https://github.com/huggingface/transformers/issues/45323")),
                   ALL, BOTH),
    "CG-007": Rule("replay picks the smallest captured batch size >= the live batch; larger batches run eagerly", U,
                   (sgl("srt/model_executor/cuda_graph_runner.py", V55, 756, "CudaGraphRunner.replay_prepare"),), ALL),
    "CG-008": Rule("graph page tables have at least ceil(max K_b / P) columns; replay checks the pages fit", K,
                   (_fb(1245, "FlashAttentionBackend.init_cuda_graph_state"),
                    sgl(FA3B, NEW, 2432, "FlashAttentionBackend.init_cuda_graph_state"),
                    pr(29665, "closed"), pr(35985, "open"), doc(FACTS, "page-table-columns")),
                   conformance=BOTH, violated_by=CONTEXT_WALL),
    "CG-009": Rule("real-row outputs do not depend on the padded batch size", H,
                   (doc(FACTS, "split-kv-and-graph-replay"),),
                   upstream="no such promise: FA3's split-KV heuristic sees the padded batch, so on a GPU real rows "
                            "agree within T1 (bitwise only for the CPU emulator)"),
    "CG-010": Rule("capture-time dummy metadata has K >= q (no empty causal span)", H,
                   (sgl(FA3B, NEW, 3393, "FlashAttentionBackend.get_cuda_graph_seq_len_fill_value"),
                    sgl("srt/speculative/eagle_draft_extend_cuda_graph_runner.py", OLD, 453,
                        "EAGLEDraftExtendCudaGraphRunner.replay"),
                    external("tokenspeed#446", "https://github.com/lightseekorg/tokenspeed/issues/446")),
                   upstream="padded draft-extend rows get seq_lens 1 with W query rows (K = 1 < q = W) since #15207; "
                            "upstream relies on FA3 returning 0 for rows with no visible key (PA-005)"),
    # --- spec decode ---------------------------------------------------------------------
    "SD-001": Rule("greedy acceptance: n = longest prefix with d_i == p_(i-1); num_accept_tokens a = n + 1", U,
                   (sgl("srt/speculative/eagle_info.py", V55, 286, "EagleVerifyInput.verify"),), (V55, OLD)),
    "SD-002": Rule("lossless: speculative output tokens equal plain greedy decoding of the target", U,
                   (sgl("srt/speculative/eagle_info.py", V55, 189, "EagleVerifyInput.verify"),), (V55, OLD)),
    "SD-003": Rule("accept length = emitted tokens / verify rounds, in [1, Sd + 1]", U,
                   (sgl("test/send_one.py", V55, 166, "send_one_prompt"),), ALL),
    "SD-004": Rule("v1 draft extend runs the a accepted tokens packed and keeps each request's last row", U,
                   (sgl("srt/speculative/eagle_info.py", V55, 664, "EagleDraftInput.prepare_extend_after_decode"),),
                   (V55, OLD)),
    "SD-005": Rule("v2 draft extend runs all N rows per request and keeps row b * N + a_b - 1", U,
                   (sgl("srt/speculative/eagle_worker_v2.py", V55, 447, "EagleDraftWorker._draft_extend_for_decode"),), ALL),
    "SD-006": Rule("v1 and v2 draft extend agree on the kept row; rows >= a_b cannot affect rows < a_b", H,
                   (doc("spec/spec-decode.md", "sd-006"),),
                   upstream="not stated upstream: it follows from PA-004 and is refspec's cross-check of CG-003/CG-004"),
    "SD-007": Rule("the draft position rule: the draft token at KV index p runs at RoPE position p", U,
                   (sgl("srt/speculative/eagle_worker_v2.py", OLD, 481, "EagleDraftWorker.draft_forward"),
                    sgl("kernels/ops/speculative/cache_locs.py", NEW, 75, "assign_draft_cache_locs_contiguous"),
                    sgl("srt/speculative/eagle_worker.py", V55, 610, "EAGLEWorker.draft_forward")), (OLD, NEW),
                   upstream="up to v0.5.10 (and at the commits refspec mirrors) draft decode step s wrote KV index "
                            "L + s but ran at position L + 1 + s (positions += 1 before each step)"),
    "SD-008": Rule("after every round target-KV length == draft-KV length == prompt + sum(a)", U,
                   (sgl("srt/speculative/eagle_info.py", V55, 488, "EagleVerifyInput.verify"),), (V55, OLD)),
    "SD-009": Rule("per-request results do not depend on batch composition or order", H,
                   (doc("spec/spec-decode.md", "sd-009"),),
                   upstream="batch invariance only with --enable-deterministic-inference (num_splits = 1)"),
    "SD-010": Rule("top-k = 1: N = Sd + 1 draft tokens are verified per request", U,
                   (sgl("srt/server_args.py", V55, 1604, "ServerArgs._handle_speculative_decoding"),), (V55, OLD)),
    # --- top-k > 1 trees, the oracle side (docs/spec/tree.md) ----------------------------
    "TR-001": Rule("tree expansion: k root children, then each frontier row's top-k, cumulative product scores, "
                   "top-k of k^2", U, (sgl(SPEC_UTILS, NEW, 474, "select_top_k_tokens"),)),
    "TR-002": Rule("selection: the N-1 drafts are the top-(N-1) of k + (Sd-1)k^2 scores, sorted by candidate id", U,
                   (sgl(EAGLE_UTILS, NEW, 100, "organize_draft_results"),)),
    "TR-003": Rule("tree links: node 0 is the root; a node's parent is the node of its parent candidate; "
                   "children ascending", U, (sgl(EAGLE_UTILS, NEW, 138, "build_tree_kernel_efficient"),)),
    "TR-004": Rule("ancestor mask: verify row i sees the prefix, itself and its ancestors, nothing else of the tree", U,
                   (sgl(SPEC_TREE, NEW, 53, "sgl_build_tree_kernel_efficient_triton"),)),
    "TR-005": Rule("tree positions: node i runs at RoPE position L + depth(i)", U,
                   (sgl(SPEC_TREE, NEW, 53, "sgl_build_tree_kernel_efficient_triton"),)),
    "TR-006": Rule("greedy tree acceptance: from the root take the child equal to the target argmax; a = n + 1", U,
                   (sgl(SPEC_TREE, NEW, 211, "verify_tree_greedy_kernel_triton"),)),
    "TR-007": Rule("accepted-path commit: the path's target KV moves to L..L+a-1; the draft extend runs the path first",
                   U, (sgl(EAGLE_WORKER, OLD, 935, "EAGLEWorker.verify"), sgl(EWC, NEW, 524, "_compact_accept_to_front"))),
    "TR-008": Rule("tree draft decode: row t at step s sees the prefix and the KV its own row wrote at steps 0..s", U,
                   (_fb(990, "FlashAttentionBackend.init_forward_metadata", NEW),)),
    "TR-009": Rule("lossless tree: the top-k tree loop equals plain greedy (and the chain loop at top-k = 1)", U,
                   (sgl(EAGLE_WORKER, OLD, 935, "EAGLEWorker.verify"),)),
    # --- the FA3 tree path (docs/spec/tree.md, "The FA3 tree path") ----------------------
    "TR-010": Rule("tree verify prefix: K = L, cu_seqlens_q = arange(0, B*N+1, N), max_seqlen_q = N, causal=False", U,
                   (_fb(1086, "FlashAttentionBackend.init_forward_metadata", NEW),
                    _fb(1591, "FlashAttentionBackend.forward_extend", NEW)), (OLD, NEW), BOTH),
    "TR-011": Rule("tree verify expand: one sequence per node, K = mask row sum, table = its allowed verify slots "
                   "first (page-1 view)", U,
                   (_fb(1166, "FlashAttentionBackend.init_forward_metadata", NEW),
                    pr(7725, "expand call on the page-size-1 view")), (OLD, NEW), BOTH),
    "TR-012": Rule("cascade merge: LSE-rescaled sum of prefix and expand equals attention over their union", U,
                   (_fb(2340, "FlashAttentionBackend.forward_decode", NEW), _fb(1865, "FlashAttentionBackend.forward_extend", NEW))),
    "TR-013": Rule("tree draft decode prefix: B*k rows packed k per request, K = L - (L mod P if P > 1)", U,
                   (_fb(946, "FlashAttentionBackend.init_forward_metadata", NEW),
                    _fb(1341, "FlashAttentionBackend.init_forward_metadata", NEW), pr(7725)), (OLD, NEW), BOTH),
    "TR-014": Rule("tree draft decode expand: K = s + 1 (+ L mod P), table = the row's own step slots (P = 1) or "
                   "unique pages (P > 1)", U,
                   (_fb(990, "FlashAttentionBackend.init_forward_metadata", NEW),
                    _fb(1344, "FlashAttentionBackend.init_forward_metadata", NEW), pr(7239, "view(-1, S)"),
                    pr(7725), pr(15469, "unique consecutive pages")), (OLD, NEW), BOTH),
    "TR-015": Rule("branch KV layout: branch t owns a page-aligned region; the partial tail page is copied into "
                   "branches t >= 1", U,
                   (sgl(EWC, NEW, 241, "prepare_for_draft"), sgl(EWC, NEW, 65, "duplicate_prefix_tail_to_draft_branches"),
                    pr(4908, "P > 1 for top-k = 1 only"), pr(7725, "copies the real tail KV")), (NEW,), (NEW,)),
    "TR-016": Rule("the production tree (organize_draft_results, build_tree_efficient, VerifyTreeGreedy) equals "
                   "the rule", U,
                   (sgl(EAGLE_UTILS, NEW, 100, "organize_draft_results"), sgl(EAGLE_UTILS, NEW, 138, "build_tree_kernel_efficient"),
                    sgl(SPEC_TREE, NEW, 480, "verify_tree_greedy_func")), (NEW,), (NEW,)),
    "TR-017": Rule("accepted-path compaction: path KV to the first a verify slots; whole pages from ceil_P(L + a) "
                   "freed, none leaked", U,
                   (sgl("srt/speculative/eagle_info.py", OLD, 236, "EagleVerifyInput.verify"),
                    sgl(SPEC_UTILS, OLD, 411, "get_src_tgt_cache_loc"))),  # P > 1 (P = 1: tree.md)
    "TR-018": Rule("tree graphs: verify / draft-decode metadata replayed in place (draft expand: cache_loc sliced "
                   "to its s+1 step columns, into an s+2 column table) equals eager", U,
                   (pr(25077, "the bug family"), pr(27360, "the fix: the slice at the graph call site"),
                    sgl("srt/debug_utils/pr_fix_toggle.py", NEW, 76, "_PR_REVERT_YAML_27360"), pr(15469)),
                   (NEW,), BOTH),
    "TR-019": Rule("lossless FA3 tree loop: production top-k loop == plain greedy == the oracle tree loop, every "
                   "page freed", U,
                   (sgl(EAGLE_WORKER, OLD, 935, "EAGLEWorker.verify"),)),
    # --- the spec-v2 tree round (docs/spec/tree.md, "The v2 tree round") ------------------
    "TR-020": Rule("v2 tree KV: reserve L + alloc_len_per_decode before a round; the branch slots live in it, the "
                   "path KV moves to the first a verify slots, nothing is freed until the request finishes", U,
                   (sgl("srt/mem_cache/allocation_sizing.py", NEW, 28, "get_alloc_len_per_decode"),
                    sgl("srt/speculative/eagle_utils.py", NEW, 857, "eagle_prepare_for_decode"),
                    sgl("srt/speculative/eagle_worker_common.py", NEW, 241, "prepare_for_draft"),
                    sgl(SPEC_UTILS, NEW, 859, "move_accept_tokens_to_target_kvcache")), (NEW,),
                   upstream="upstream reserves 2x (get_alloc_reserve_per_decode, the overlap double buffer) "
                            "rounded up to whole pages; refspec reserves that under its overlap schedule "
                            "and 1x in its non-overlapped round"),
    "TR-021": Rule("v2 tree draft extend: DRAFT_EXTEND_V2 over all N = num_draft_tokens window rows at L..L+N-1, "
                   "predict and hidden compacted to the front, row b*N + a - 1 kept", U,
                   (sgl("srt/speculative/eagle_worker_v2.py", NEW, 1110, "EagleDraftWorker._draft_extend_for_decode"),
                    sgl("srt/speculative/eagle_worker_common.py", NEW, 524, "_compact_accept_to_front"),
                    sgl("srt/speculative/eagle_worker_common.py", NEW, 112, "prepare_for_draft_extend")), (NEW,)),
    # --- MLA: the latent KV row, its views, the qv kernel call (docs/spec/mla.md) -----------
    "ML-001": Rule("the MLA pool holds one row per slot and layer, [slots, 1, kv_lora_rank + qk_rope_head_dim] = "
                   "[c_kv | k_rope]; slot 0 is the padding slot", U,
                   (sgl(MP, NEW, 4856, "MLATokenToKVPool._create_buffers"),
                    sgl(MP, NEW, 4893, "MLATokenToKVPool.get_key_buffer"),
                    sgl(MP, OLD, 1672, "MLATokenToKVPool._create_buffers")), BOTH),
    "ML-002": Rule("set_mla_kv_buffer writes the row [k_nope | k_rope] at out_cache_loc, cast to the pool dtype, "
                   "and never writes slot 0", U,
                   (sgl(MP, NEW, 5026, "MLATokenToKVPool.set_mla_kv_buffer"),
                    sgl("kernels/ops/kvcache/mla_buffer.py", NEW, 42, "set_mla_kv_buffer_kernel"),
                    pr(36003, "skip the reserved slot 0"), pr(36207), pr(32477, "the generic writer's fix")), (NEW,),
                   violated_by="v0.5.12.post1: set_mla_kv_buffer_triton (srt/mem_cache/utils.py) stores every row, "
                               "so CUDA-graph and DP-attention padding rows (out_cache_loc 0) overwrite slot 0 and "
                               "later reads of it see NaN; fixed by sglang#36003 (reserved_skip_index=0)"),
    "ML-003": Rule("the kernel reads the row as two strided paged views split at the layer's v_head_dim: "
                   "k_rope [NP, P, 1, D - Dv] and c_kv [NP, P, 1, Dv], strides (row * P, row, row, 1)", U,
                   (sgl(FA3B, NEW, 1944, "FlashAttentionBackend.forward_extend"),
                    sgl(FA3B, NEW, 2350, "FlashAttentionBackend.forward_decode"),
                    sgl("srt/mem_cache/layout/paged_view.py", NEW, 11, "paged_view"),
                    sgl(FA3B, OLD, 953, "FlashAttentionBackend.forward_extend")), BOTH),
    "ML-004": Rule("MLA changes no metadata: cache_seqlens, cu_seqlens_q/k, page_table and the top-k > 1 expand "
                   "metadata are the MHA ones in every mode, eager and under graphs", U,
                   (sgl(FA3B, NEW, 890, "FlashAttentionBackend.init_forward_metadata"),
                    sgl(FA3B, NEW, 416, "FlashAttentionBackend._compute_scheduler_metadata"),
                    sgl(FA3B, NEW, 3477, "FlashAttentionMultiStepBackend"),
                    sgl(FA3B, OLD, 272, "FlashAttentionBackend.init_forward_metadata")), BOTH,
                   upstream="the one MLA branch of the metadata is off-path: no FA3 scheduler-metadata precompute"),
    "ML-005": Rule("the qv call: S = scale * (q_rope . k_rope + qv . c_kv) over one KV head, O = softmax(S) c_kv, "
                   "output [T, H, Dv]; qv is [T, H, Dv] like q's rows", K,
                   (fa3("flash_api_stable.cpp", 1095, "mha_fwd"), fa3("test_util.py", 287, "attention_ref"),
                    fa3("flash_attn_interface.py", 942, "flash_attn_with_kvcache"),
                    sgl(FA3B, NEW, 2012, "FlashAttentionBackend.forward_extend"))),
    "ML-006": Rule("FA3 has a kernel for head dims D != Dv only for (D <= 64, Dv <= 512) or (128 < D <= 192, "
                   "96 < Dv <= 128); qv needs D <= 64 and Dv >= 256", K,
                   (fa3("flash_api_stable.cpp", 850, "mha_fwd"), fa3("flash_api_stable.cpp", 1095, "mha_fwd"),
                    fa3("flash_api_stable.cpp", 321, "run_mha_fwd_constexpr"))),
    "ML-007": Rule("the MLA softmax scale is (qk_nope + qk_rope)^-0.5 * mscale^2, passed explicitly; never FA3's "
                   "qv default (D + Dv)^-0.5 = 576^-0.5", U,
                   (sgl(DSV2, NEW, 2059, "DeepseekV2AttentionMLA.__init__"),
                    sgl(DSV2, NEW, 2178, "DeepseekV2AttentionMLA.__init__"),
                    sgl("srt/configs/model_config.py", NEW, 2623, "compute_mla_mscale_scaling"),
                    sgl("srt/configs/model_config.py", NEW, 2617, "yarn_get_mscale"),
                    fa3("flash_attn_interface.py", 1062, "flash_attn_with_kvcache")), (NEW,)),
    "ML-008": Rule("absorption identity: attention over per-head k = [W_UK c | k_pe], v = W_UV c equals "
                   "attention over the latent row with q = [W_UK^T q_nope | q_pe], then W_UV", U,
                   (sgl(FWD_MLA, NEW, 586, "DeepseekMLAForwardMixin.forward_absorb_prepare"),
                    sgl(FWD_MLA, NEW, 927, "DeepseekMLAForwardMixin.forward_absorb_core"),
                    sgl(FWD_MHA, NEW, 288, "DeepseekMHAForwardMixin.forward_normal_prepare"),
                    doc(MLA_PAGE, "the-math")), (NEW,)),
    "ML-009": Rule("path choice: a plain extend whose summed prefix is 0 (or >= 8192 with the chunked prefix "
                   "cache on) runs non-absorbed MHA; every other batch runs absorbed MLA", U,
                   (sgl(DH, NEW, 108, "_handle_attention_backend"), sgl(DH, NEW, 147, "handle_attention_fa3"),
                    sgl("srt/environ.py", NEW, 723, "SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD"),
                    sgl(DH, OLD, 72, "_handle_attention_backend")), BOTH),
    "ML-010": Rule("the non-absorbed prefill: flash_attn_varlen_func on ragged q [T, H, 192], k [sum K, H, 192], "
                   "v [sum K, H, 128] with cu_seqlens_k = the metadata's, causal bottom-right; the backend stores "
                   "nothing", U,
                   (sgl(FA3B, NEW, 1918, "FlashAttentionBackend.forward_extend"),
                    sgl(FWD_MHA, NEW, 253, "DeepseekMHAForwardMixin.forward_normal_prepare"),
                    sgl(FWD_MHA, NEW, 431, "DeepseekMHAForwardMixin.forward_normal_one_shot_core"),
                    fa3("flash_attn_interface.py", 890, "flash_attn_varlen_func")), BOTH),
    "ML-011": Rule("MLA top-k > 1: the MHA cascade with the MLA call; the verify expand call reads the page-size-1 "
                   "views, because its table holds token slots", K,
                   (sgl(FA3B, NEW, 1844, "FlashAttentionBackend.forward_extend"),
                    sgl(FA3B, NEW, 2034, "FlashAttentionBackend.forward_extend"),
                    sgl(FA3B, NEW, 2387, "FlashAttentionBackend.forward_decode"), pr(7725, "page-size-1 expand view")),
                   violated_by=MLA_VERIFY_EXPAND),
    "ML-012": Rule("move_kv_cache moves whole MLA rows, pool[tgt] = pool[src], in every layer (the tree and v2 "
                   "KV moves)", U,
                   (sgl(MP, NEW, 5079, "MLATokenToKVPool.move_kv_cache"), pr(26982, "add it"),
                    sgl("srt/speculative/eagle_worker.py", OLD, 729, "EAGLEWorker._draft_preprocess_decode")), (NEW,),
                   violated_by="v0.5.12.post1: MLATokenToKVPool has no move_kv_cache, so MLA + EAGLE with top-k > 1 "
                               "and P > 1 fails at its first tail copy (eagle_worker.py L729, "
                               "_draft_preprocess_decode) or, when every tail page is full, right after the verify "
                               "(eagle_info.py L543); reachable (server_args.py L3837-3844 lets fa3 run top-k > 1 "
                               "with P > 1) and run: python -m refspec conformance shows it as the known upstream bug "
                               "mla-pool-no-move-kv-cache; added by sglang#26982"),
    "ML-013": Rule("on CUDA, MLA runs only on an FA3 build whose configuration has the hdim 64/512 kernel (and, "
                   "for the prefill, 192/128); refspec refuses any other build", H,
                   (fa3("setup.py", 71, "DISABLE_HDIMDIFF64"), fa3("setup.py", 102, "create_build_config_file"),
                    fa3("flash_api_stable.cpp", 321, "run_mha_fwd_constexpr"), doc(MLA_PAGE, "the-gpu-build")),
                   upstream="SGLang runs whichever FA3 it loads and checks no build flag: on a build without "
                            "HDIMDIFF64 the qv call passes the host checks and returns a wrong result silently"),
    # --- tolerances ----------------------------------------------------------------------
    "TOL-001": Rule("T0: bitwise equality (metadata, bookkeeping, graph vs eager, fp32 token streams)", H,
                    (doc("tolerance-policy.md"),),
                    upstream="upstream tests compare metadata exactly but outputs by accuracy thresholds"),
    "TOL-002": Rule("T1: low-precision error <= 2x the oracle's own low-precision error + a floor", K,
                    (fa3("test_flash_attn.py", 285, "test_flash_attn_output"),
                     doc("tolerance-policy.md"))),
    "TOL-003": Rule("T2: tokens equal except where the baseline's top-2 logit margin is below delta", H,
                    (doc("tolerance-policy.md"),),
                    upstream="upstream end-to-end tests assert GSM8K accuracy and accept length, not tokens"),
}

#: ``ID -> one-line title`` (what error messages and the docs' ID index print)
INVARIANTS: dict[str, str] = {inv_id: rule.title for inv_id, rule in RULES.items()}


class InvariantError(ValueError):
    """A violated refspec invariant.

    ``str(err)`` is ``[ID] title: detail [level]``: the rule first, then what was seen, then the
    rule's conformance level (``refspec hardening`` means stricter than SGLang), so that it can
    be quoted in a review as is.  ``err.inv_id`` holds the ID, ``err.rule`` its :class:`Rule`.

    Raises: KeyError for an ID that is not in :data:`RULES`.
    """

    def __init__(self, inv_id: str, detail: str):
        if inv_id not in RULES:
            raise KeyError(f"unknown invariant id {inv_id!r}")
        self.inv_id = inv_id
        self.rule = RULES[inv_id]
        self.detail = detail
        super().__init__(f"[{inv_id}] {self.rule.title}: {detail} [{self.rule.level}]")


def require(cond: bool, inv_id: str, detail) -> None:
    """Raise :class:`InvariantError` ``inv_id`` unless ``cond``; ``detail`` may be a callable."""
    if not cond:
        raise InvariantError(inv_id, detail() if callable(detail) else detail)
