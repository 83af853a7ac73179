//! The lessons, in teaching order: the incidents' sentences and what each step does.

use super::live::{Act, Ask, CacheReset, LiveSpec, Pic, Read};
use super::planned::{Fig, StepSpec};
use super::Lesson;

/// Every lesson, in teaching order.
pub const LESSONS: &[Lesson] = &[
    Lesson {
        name: "kv-cache-too-small",
        title: "\"KV cache needed is larger than the available KV cache memory\"",
        incident: "Qwen3-VL-32B on two Ascend 910B with --max-model-len 262144 refuses to start: one request of that length needs more KV than the cards have left.",
        planned: &[
            StepSpec {
                say: "Every token a request has seen keeps its attention keys and values on the GPU (the KV cache, in blocks of 16 tokens), so that the next token does not recompute them. vLLM starts only if one request of --max-model-len fits in that cache. At 262,144 tokens Qwen3-VL-32B needs 32 GiB of keys and values per rank (with --tensor-parallel-size 2 each of the two cards holds half the model and half the KV); after the weights and the profile run's activations each card has 20.06 GiB left (lesson 2 shows how start-up finds that number). So vLLM refuses, and names the longest length that fits.",
                query: "model=Qwen3-VL-32B-Instruct&device=ascend-910b-64g&tp=2&kv_cache_memory_gib=20.06&max_model_len=262144",
                figures: &[Fig::NeededKv, Fig::AvailableKv, Fig::Fits, Fig::EstimatedMaxLen],
            },
            StepSpec {
                say: "Start it with the length vLLM named: the same 20.06 GiB now holds one full-length request. The memory did not change; only what one request may ask for did.",
                query: "model=Qwen3-VL-32B-Instruct&device=ascend-910b-64g&tp=2&kv_cache_memory_gib=20.06&max_model_len=164224",
                figures: &[Fig::NeededKv, Fig::AvailableKv, Fig::Fits],
            },
        ],
        live: &[
            LiveSpec {
                say: "The same effect at tab scale: shrink the KV cache of the model in this tab to 8 blocks of 16 tokens. The longest request it can hold is now 128 tokens, and its --max-model-len falls to that (vLLM, given a longer one, refuses to start, as in step 1).",
                act: Act::Configure { kv_blocks: Some(8) },
                figures: &[Read::KvBlocks, Read::KvCacheBytes, Read::MaxModelLen],
            },
            LiveSpec {
                say: "Ask for a reply of 200 tokens: prompt and reply would need more than the 128 tokens one request may have, so the engine refuses it before it takes a single block, and says why.",
                act: Act::Refuse(&Ask { id: "too-long", text: "Tell me a long story about a lighthouse keeper.", image: None, max_tokens: 200 }),
                figures: &[Read::PromptTokens, Read::Refusal, Read::KvInUse],
            },
        ],
    },
    Lesson {
        name: "startup-budget",
        title: "Where the start-up budget goes",
        incident: "Qwen3-VL-8B on two Ascend 910B at --gpu-memory-utilization 0.95: which memory is the KV cache's, and what the flag moves.",
        planned: &[
            StepSpec {
                say: "At start-up vLLM loads the weights, runs one profile step at the largest batch, and measures: weights, the torch peak increase of that step, and memory outside torch. Their sum is the non-KV memory; the KV cache gets what is left of total × --gpu-memory-utilization.",
                query: "model=Qwen3-VL-8B-Instruct&device=ascend-910b-64g&tp=2&gpu_memory_utilization=0.95&weights_gib=9.19&activation_peak_gib=3.86&non_torch_gib=0.56",
                figures: &[
                    Fig::Weights,
                    Fig::ActivationPeak,
                    Fig::NonTorch,
                    Fig::NonKv,
                    Fig::Total,
                    Fig::Requested,
                    Fig::AvailableKv,
                    Fig::KvTokens,
                ],
            },
            StepSpec {
                say: "Lower --gpu-memory-utilization to 0.90: the non-KV lines stay where they were, and the whole difference comes out of the KV cache. The flag sizes the KV cache, nothing else.",
                query: "model=Qwen3-VL-8B-Instruct&device=ascend-910b-64g&tp=2&gpu_memory_utilization=0.9&weights_gib=9.19&activation_peak_gib=3.86&non_torch_gib=0.56",
                figures: &[Fig::NonKv, Fig::Requested, Fig::AvailableKv, Fig::KvTokens],
            },
        ],
        live: &[LiveSpec {
            say: "The same lines for the model in this tab, as its start-up measured them: its weights as loaded, the peak of its profile run, and its KV cache. Here the KV cache is set by size (the playground's KV blocks, vLLM's --kv-cache-memory-bytes), which skips the utilization rule; the weights and the profile peak still had to fit beside it.",
            act: Act::Configure { kv_blocks: None },
            figures: &[Read::WeightsBytes, Read::ProfiledPeak, Read::KvCacheBytes, Read::KvBlocks],
        }],
    },
    Lesson {
        name: "encoder-budget",
        title: "The encoder budget and the profile run",
        incident: "Qwen3-VL-8B logs \"Encoder cache will be initialized with a budget of 32768 tokens, and profiled with 2 image items of the maximum feature size\": where those numbers come from.",
        planned: &[
            StepSpec {
                say: "The vision tower (the encoder) turns an image into tokens for the language model; the encoder cache keeps those outputs so that an image is not encoded twice. The largest image the processor accepts (4096×4096 for Qwen3-VL: 16×16-pixel patches, merged 2×2 into one token) becomes 16,384 tokens. The encoder cache holds at least one such image and at least one step's tokens: max(32,768, 16,384) = 32,768. The profile run encodes as many of the largest images as that budget holds: 2. Their activations are part of the torch peak the KV cache is sized after.",
                query: "model=Qwen3-VL-8B-Instruct&device=h100-80g&max_num_batched_tokens=32768",
                figures: ENCODER_FIGURES,
            },
            StepSpec {
                say: "With --max-num-batched-tokens 8192 the budget falls to one largest image (16,384 tokens) and the profile run encodes one: a smaller activation peak, more KV cache, and images that must wait for the encoder more often.",
                query: "model=Qwen3-VL-8B-Instruct&device=h100-80g&max_num_batched_tokens=8192",
                figures: ENCODER_FIGURES,
            },
            StepSpec {
                say: "With --limit-mm-per-prompt image=0,video=0 the server takes no images and the profile run encodes none: no encoder budget, no encoder cache, an activation peak of the text batch alone, and more KV cache. (With image=0 alone, videos are still allowed and the profile run encodes a video instead.) vLLM's --skip-mm-profiling skips the images in the profile run while still accepting them; the next lesson shows what that risks.",
                query: "model=Qwen3-VL-8B-Instruct&device=h100-80g&max_num_batched_tokens=8192&limit_mm_per_prompt=image=0,video=0",
                figures: ENCODER_FIGURES,
            },
        ],
        live: &[LiveSpec {
            say: "The same rule for the model in this tab: its largest image (the playground's max_pixels), its encoder budget, max(--max-num-batched-tokens, largest image), and how many of the largest images its profile run encoded.",
            act: Act::Configure { kv_blocks: None },
            figures: &[Read::ProfiledImageTokens, Read::EncoderBudget, Read::ProfiledImages, Read::ProfiledPeak],
        }],
    },
    Lesson {
        name: "oom-image-29",
        title: "The out-of-memory at image 29 of 60",
        incident: "A Qwen3-VL server ran 28 images of a 60-image benchmark and died on the 29th: larger than any image its start-up profile run had encoded, it pushed the vision tower's memory past what vLLM had set aside.",
        planned: &[],
        live: &[
            LiveSpec {
                say: "At start-up the engine ran its vision tower on the largest images it allows (as many as the encoder budget holds, lesson 3), measured the memory that took, and gave what was left to the KV cache. That profile peak also covers a full batch of tokens, so it is well above what these small requests need. Send three photos no larger than the profiled image (the figures are the last photo's): each step's peak stays within the profiled one, because nothing larger than what was measured runs. The peaks come from the ledger, kvlens's count of every byte the backend holds by category (staging: the buffers between host and device).",
                act: Act::Send(&[
                    Ask { id: "photo-1", text: "Describe this photo.", image: Some(Pic { quarters: 4, seed: 1 }), max_tokens: 4 },
                    Ask { id: "photo-2", text: "Describe this photo.", image: Some(Pic { quarters: 4, seed: 2 }), max_tokens: 4 },
                    Ask { id: "photo-3", text: "Describe this photo.", image: Some(Pic { quarters: 4, seed: 3 }), max_tokens: 4 },
                ]),
                figures: &[Read::ProfiledImageTokens, Read::SentTokens, Read::StepPeak, Read::ProfiledPeak],
            },
            LiveSpec {
                say: "Image 29 has four times as many tokens (twice the side). vLLM encodes an image at whatever size its processor allows, and a request can allow more than the profile run saw (a larger max_pixels in mm_processor_kwargs, or --skip-mm-profiling). A vision layer compares every patch (a token is 2×2 patches) with every other, so a kernel that stores those scores in full needs memory that grows with the square of the patches: at its own size this image's scores alone can pass the profiled peak. That is memory nobody measured, needed in the middle of serving, and the process dies. kvlens resizes every image to the profiled maximum instead, and this step's measured peak stays within the profiled one (its kernels never store the scores in full, which is why the measured peak is below even the resized estimate). The price is resolution.",
                act: Act::Send(&[Ask { id: "photo-29", text: "Describe this photo.", image: Some(Pic { quarters: 16, seed: 29 }), max_tokens: 4 }]),
                figures: &[
                    Read::OwnSizeTokens,
                    Read::SentTokens,
                    Read::ScoresOwnSize,
                    Read::ScoresSent,
                    Read::ScoresVsProfiled,
                    Read::StepPeak,
                    Read::ProfiledPeak,
                ],
            },
        ],
    },
    Lesson {
        name: "reset-mm-cache",
        title: "Memory that /reset_mm_cache does not return",
        incident: "After a multimodal benchmark a vLLM server's GPU memory stayed high, and POST /reset_mm_cache did not bring it down: that endpoint empties the processor cache only, which lives in host memory.",
        planned: &[],
        live: &[
            LiveSpec {
                say: "One request with one image. Three caches now hold something of it: the processor cache (the image decoded and resized, in host memory, so it is not preprocessed again), the encoder cache (the vision tower's output, in device memory, so it is not encoded again) and the KV cache (the keys and values of every prompt token, in blocks of 16 tokens; the request has ended, so its blocks are free, but they keep their hash so a later prompt with the same start can reuse them).",
                act: Act::Send(&[Ask { id: "picture", text: "What is in this picture?", image: Some(Pic { quarters: 4, seed: 5 }), max_tokens: 8 }]),
                figures: &[
                    Read::ProcessorEntries,
                    Read::ProcessorBytes,
                    Read::EncoderEntries,
                    Read::EncoderBytes,
                    Read::KvInUse,
                    Read::KvCached,
                    Read::DeviceBytes,
                ],
            },
            LiveSpec {
                say: "POST /reset_mm_cache, as vLLM does it: the processor cache is empty. The encoder cache and the KV blocks hold what they held, so the device memory did not move.",
                act: Act::Reset(CacheReset::Processor),
                figures: &[
                    Read::ProcessorEntries,
                    Read::ProcessorBytes,
                    Read::EncoderEntries,
                    Read::EncoderBytes,
                    Read::KvCached,
                    Read::DeviceBytes,
                ],
            },
            LiveSpec {
                say: "POST /reset_encoder_cache (vLLM has it since early 2026): the vision tower's outputs go, and the device memory they held with them. (vLLM hands the freed tensors back to PyTorch's allocator, which keeps them reserved: nvidia-smi may not show the drop.)",
                act: Act::Reset(CacheReset::Encoder),
                figures: &[Read::EncoderEntries, Read::EncoderBytes, Read::KvCached, Read::DeviceBytes],
            },
            LiveSpec {
                say: "POST /reset_prefix_cache: the free KV blocks forget their hashes. Their memory stays allocated: the KV cache is sized once at start-up and never shrinks, so a server's GPU memory stays high after any benchmark, by design. Only whether its blocks can be reused changes.",
                act: Act::Reset(CacheReset::Prefix),
                figures: &[Read::KvBlocks, Read::KvInUse, Read::KvCached, Read::DeviceBytes],
            },
        ],
    },
    Lesson {
        name: "prefix-caching-images",
        title: "Prefix caching with images",
        incident: "A chat app sends the same image with every turn: is it encoded again each time? And a different image with the same question: could the cache answer about the wrong picture?",
        planned: &[],
        live: &[
            LiveSpec {
                say: "The first request computes everything: the vision tower encodes the image, and the language model (the decoder) computes every prompt token. Full KV blocks get a hash that chains all tokens before them; an image's tokens hash with the image's content.",
                act: Act::Send(&[Ask { id: "first", text: CATALOGUE_QUESTION, image: Some(Pic { quarters: 4, seed: 7 }), max_tokens: 4 }]),
                figures: &[Read::PromptTokens, Read::PrefixHitTokens, Read::PromptComputed, Read::VisionRuns],
            },
            LiveSpec {
                say: "The same text and image again. Every full block's hash matches, so the decoder computes only the tokens after the last full block. The vision tower does not run: the image's tokens that reach past the last full block (compare their positions with the tokens found) take their output from the encoder cache.",
                act: Act::Send(&[Ask { id: "again", text: CATALOGUE_QUESTION, image: Some(Pic { quarters: 4, seed: 7 }), max_tokens: 4 }]),
                figures: &[
                    Read::PromptTokens,
                    Read::ImagePlace,
                    Read::PrefixHitTokens,
                    Read::PromptComputed,
                    Read::VisionRuns,
                    Read::EncoderHits,
                ],
            },
            LiveSpec {
                say: "The same text with a different image. The blocks of text before the image still match; from the image on the hashes differ, so the image is encoded and everything after it computed. A cache keyed by the text alone would have answered about the wrong picture.",
                act: Act::Send(&[Ask { id: "other", text: CATALOGUE_QUESTION, image: Some(Pic { quarters: 4, seed: 8 }), max_tokens: 4 }]),
                figures: &[Read::PromptTokens, Read::ImagePlace, Read::PrefixHitTokens, Read::PromptComputed, Read::VisionRuns],
            },
        ],
    },
    Lesson {
        name: "preemption",
        title: "Preemption: too few KV blocks for the running requests",
        incident: "Under load a vLLM server logs preempted requests and its throughput drops: the running requests needed more KV blocks than were free, so one was stopped, its blocks freed, and its tokens computed again later.",
        planned: &[],
        live: &[
            LiveSpec {
                say: "Shrink the KV cache to 8 blocks of 16 tokens (what vLLM's --num-gpu-blocks-override 8 does): 128 tokens for all running requests together. Each request below fits alone (step 2 shows how many blocks it needs); three at once do not.",
                act: Act::Configure { kv_blocks: Some(8) },
                figures: &[Read::KvBlocks, Read::KvInUse],
            },
            LiveSpec {
                say: "Send three requests at once. Each needs a new block every 16 tokens it generates; when none is free, the scheduler preempts the request that arrived last (vLLM's first-come-first-served policy): its blocks are freed, it goes back to the waiting queue, and when blocks free up it runs again from its prompt plus the tokens it had generated.",
                act: Act::Send(THREE_STORIES),
                figures: &[
                    Read::BlocksPerRequest,
                    Read::Preemptions,
                    Read::PromptTokens,
                    Read::PrefixHitTokens,
                    Read::Generated,
                ],
            },
            LiveSpec {
                say: "Give the KV cache back its own size.",
                act: Act::Configure { kv_blocks: None },
                figures: &[Read::KvBlocks],
            },
            LiveSpec {
                say: "The same three requests with room for all: no preemption, and the same replies token for token. The preempted run computed more positions than this one: the difference is what preemption cost, the preempted request's prompt and the tokens it had generated, computed again. Its freed blocks kept their hashes, but the other requests needed those very blocks, so the prefix cache (lesson 6) had little or nothing left to give back (step 2's prefix-cache hits). Preemption costs time, never correctness.",
                act: Act::Send(THREE_STORIES),
                figures: &[Read::Preemptions, Read::PrefixHitTokens, Read::Recomputed, Read::SameReplies],
            },
        ],
    },
    Lesson {
        name: "hybrid-state",
        title: "Why a long context costs Qwen3.5 so little KV, and what it costs instead",
        incident: "Qwen3.5-2B and Qwen3-VL-2B at a 32,768-token context on one H100: the new model needs under an eighth of the KV per request, yet vLLM logs 544-token blocks and a padded \"mamba page\" for it.",
        planned: &[
            StepSpec {
                say: "Qwen3-VL-2B attends over every token it has seen in all 28 of its layers: each token keeps 114,688 bytes of keys and values (28 layers × 2 × 8 KV heads × 128 values × 2 bytes), so one request of 32,768 tokens needs 3.5 GiB of KV cache, and the cache grows with every token.",
                query: "model=Qwen3-VL-2B-Instruct&device=h100-80g&max_model_len=32768",
                figures: &[Fig::KvPerToken, Fig::NeededKv, Fig::BlockSize, Fig::Concurrency],
            },
            StepSpec {
                say: "Qwen3.5-2B keeps full attention in only 6 of its 24 layers: 12,288 bytes per token. Its other 18 layers are Gated DeltaNet: each keeps a fixed-size state per request (a conv window and a 16 × 128 × 128 float32 matrix per layer), 18.6 MiB whatever the length. vLLM stores those states in the same block pool as the KV cache, one state per block, so it raises the block size to 544 tokens, until a block's page holds a state. One request of 32,768 tokens now needs 0.40 GiB: its attention blocks plus one padded page per state layer.",
                query: "model=Qwen3.5-2B&device=h100-80g&max_model_len=32768",
                figures: &[Fig::KvPerToken, Fig::StatePerRequest, Fig::BlockSize, Fig::NeededKv, Fig::Concurrency],
            },
            StepSpec {
                say: "The state is paid per request, not per token. Cut the requests to 2,048 tokens, 16 times shorter: a Qwen3-VL request would shrink 16 times, but each Qwen3.5 request still holds its 18 state pages beside 4 blocks of tokens, so 1443.14x such requests fit where 157.84x did: 9 times as many, not 16. With many short requests, the states decide the concurrency; with one long one, the attention layers do.",
                query: "model=Qwen3.5-2B&device=h100-80g&max_model_len=2048",
                figures: &[Fig::BlockSize, Fig::NeededKv, Fig::Concurrency],
            },
        ],
        live: &[],
    },
];

/// Lesson 3's figures, at both batch sizes.
const ENCODER_FIGURES: &[Fig] = &[
    Fig::MaxTokensPerImage,
    Fig::EncoderBudget,
    Fig::EncoderItems,
    Fig::EncoderCache,
    Fig::ActivationPeak,
    Fig::AvailableKv,
];

/// Lesson 6's question: long enough that its tokens fill KV blocks before the image.
const CATALOGUE_QUESTION: &str = "You are looking at a photo from our product catalogue. Answer in one short sentence: what colour is the object in the middle of the picture?";

/// Lesson 7's requests: each fits the small cache alone, not three at once.
const THREE_STORIES: &[Ask] = &[
    Ask {
        id: "story-a",
        text: "Tell me a long story about a lighthouse keeper.",
        image: None,
        max_tokens: 40,
    },
    Ask {
        id: "story-b",
        text: "Tell me a long story about a mountain village.",
        image: None,
        max_tokens: 40,
    },
    Ask {
        id: "story-c",
        text: "Tell me a long story about a river boat.",
        image: None,
        max_tokens: 40,
    },
];
