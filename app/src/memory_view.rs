//! The live memory view: the ledger as a stacked bar against the planner's budget, the KV block
//! grid, the encoder-cache entries, the processor cache, counters and the reset buttons. It draws
//! an [`Occupancy`], whether the in-browser engine took it or a `kvlens serve` sent it.

use kvlens_engine::cache::{KvBlockState, KvSummary};
use kvlens_engine::memory::ledger::Category;
use kvlens_engine::occupancy::{Occupancy, ProcessMemory};
use kvlens_engine::runner::StateSlots;
use leptos::prelude::*;
use std::collections::{BTreeMap, HashMap};

/// Which cache a reset button empties.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ResetKind {
    /// The prefix cache (vLLM `/reset_prefix_cache`).
    Prefix,
    /// The encoder cache (kvlens `/reset_encoder_cache`; vLLM has no such endpoint).
    Encoder,
    /// The processor cache (vLLM `/reset_mm_cache`).
    Processor,
}

/// The budget the bar is drawn against: what start-up planned for this engine.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Budget {
    /// The device's memory.
    pub total_bytes: u64,
    /// The share start-up may use (`total × gpu_memory_utilization`).
    pub requested_bytes: u64,
    /// The KV cache the budget left.
    pub kv_cache_bytes: u64,
}

/// Bytes in words: MiB above one, else KiB.
pub fn size(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / 1048576.0)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

/// A request's colour in the grid, stable for its id.
fn colour(id: &str) -> String {
    let h = id.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    format!("hsl({}, 65%, 50%)", h % 360)
}

/// One segment of the ledger bar.
struct Segment {
    label: &'static str,
    bytes: u64,
    colour: &'static str,
}

/// The bar's segments: each ledger category, the KV cache split by block state, and what the
/// budget leaves free.
fn segments(o: &Occupancy, budget: Option<&Budget>) -> (Vec<Segment>, u64) {
    let bytes = |c: Category| o.engine.ledger.iter().find(|e| e.category == c).map_or(0, |e| e.bytes);
    let peak = |c: Category| {
        o.engine
            .ledger
            .iter()
            .find(|e| e.category == c)
            .map_or(0, |e| e.peak_bytes)
    };
    let kv = bytes(Category::KvCache);
    let kv_summary = &o.engine.kv;
    let share = |n: usize| kv * n as u64 / kv_summary.num_blocks.max(1) as u64;
    let in_use = share(kv_summary.num_in_use);
    let cached = share(kv_summary.num_cached_free);
    // A hybrid model's state slots (Qwen3.5), held ones apart.
    let states_held = o.engine.states.as_ref().map_or(0, |st| {
        bytes(Category::StateCache) * st.held_by.len() as u64 / st.total.max(1) as u64
    });
    let mut s = vec![
        Segment {
            label: "weights",
            bytes: bytes(Category::Weights),
            colour: "#4c6ef5",
        },
        Segment {
            label: "KV in use",
            bytes: in_use,
            colour: "#2f9e44",
        },
        Segment {
            label: "KV cached, free",
            bytes: cached,
            colour: "#8ce99a",
        },
        Segment {
            label: "KV free",
            bytes: kv.saturating_sub(in_use + cached),
            colour: "#d3f9d8",
        },
        Segment {
            label: "states in use",
            bytes: states_held,
            colour: "#0c8599",
        },
        Segment {
            label: "states free",
            bytes: bytes(Category::StateCache).saturating_sub(states_held),
            colour: "#99e9f2",
        },
        Segment {
            label: "encoder cache",
            bytes: bytes(Category::EncoderCache),
            colour: "#ae3ec9",
        },
        Segment {
            label: "activations (peak)",
            bytes: peak(Category::Activations).max(bytes(Category::Activations)),
            colour: "#f59f00",
        },
        Segment {
            label: "staging",
            bytes: bytes(Category::Staging),
            colour: "#868e96",
        },
        Segment {
            label: "requests (host)",
            bytes: bytes(Category::Requests),
            colour: "#495057",
        },
    ];
    let used: u64 = s.iter().map(|x| x.bytes).sum();
    let total = budget.map_or(used, |b| b.requested_bytes.max(used));
    s.push(Segment {
        label: "free in the budget",
        bytes: total - used,
        colour: "#f1f3f5",
    });
    (s, total)
}

/// The ledger counts what the engine has set aside (the whole KV cache from start-up, the peak of
/// a step's activations, which are freed between steps); the operating system counts the pages the
/// process has touched (a server), a tab the engine's wasm memory, which never shrinks. Both,
/// named, where the second is known.
fn resident_line(reserved: u64, process: &ProcessMemory) -> String {
    let ledger = "KV blocks count from start-up; activations are freed between steps, so the ledger shows their peak";
    match (process.resident_bytes, process.wasm_memory_bytes) {
        (Some(r), _) => format!(
            "reserved (ledger): {} · resident (OS): {}: KV blocks count in the ledger from start-up, in \
             resident memory once written; activations are freed between steps, so the ledger shows their peak",
            size(reserved),
            size(r)
        ),
        (None, Some(w)) => format!(
            "reserved (ledger): {} · wasm memory: {}: {ledger}; wasm memory grows to the most ever held at once \
             (the load's buffers too) and never shrinks",
            size(reserved),
            size(w)
        ),
        (None, None) => format!("reserved (ledger): {}: {ledger}", size(reserved)),
    }
}

/// One cell of the KV grid.
struct Cell {
    id: usize,
    state: KvBlockState,
    owners: Vec<String>,
    /// Position of the block in its first owner's table.
    index: Option<usize>,
    /// The start of its prefix-cache hash, when it has one.
    hash: Option<String>,
}

/// Every block with its state and the requests whose tables hold it.
fn cells(kv: &KvSummary) -> Vec<Cell> {
    let mut owners: BTreeMap<usize, Vec<(String, usize)>> = BTreeMap::new();
    for (req, table) in &kv.tables {
        for (i, b) in table.iter().enumerate() {
            owners.entry(*b).or_default().push((req.as_str().to_string(), i));
        }
    }
    let mut out = Vec::with_capacity(kv.num_blocks);
    for (state, run) in &kv.runs {
        for _ in 0..*run {
            let id = out.len();
            let held = owners.remove(&id).unwrap_or_default();
            out.push(Cell {
                id,
                state: *state,
                index: held.first().map(|h| h.1),
                hash: kv.hashes.get(&id).cloned(),
                owners: held.into_iter().map(|h| h.0).collect(),
            });
        }
    }
    out
}

/// The most cells the grid draws: a server's cache of tens of thousands of blocks is drawn with
/// several blocks per cell (redrawn at every event, one cell per block would stall the page).
const MAX_CELLS: usize = KvSummary::MAX_HASHED_BLOCKS;

/// A group of consecutive blocks drawn as one cell: in use when any is (coloured by its first
/// owner), else cached-free when any is, with the counts in its tooltip.
fn group_cell(group: &[Cell]) -> impl IntoView {
    let count = |s: KvBlockState| group.iter().filter(|c| c.state == s).count();
    let pick = [KvBlockState::InUse, KvBlockState::CachedFree, KvBlockState::Free]
        .iter()
        .find_map(|s| group.iter().find(|c| c.state == *s))
        .unwrap_or(&group[0]);
    let (class, style) = match pick.state {
        KvBlockState::InUse => (
            "used",
            format!("background: {}", colour(pick.owners.first().map_or("", |s| s.as_str()))),
        ),
        KvBlockState::CachedFree => ("cached", String::new()),
        KvBlockState::Null => ("null", String::new()),
        KvBlockState::Free => ("free", String::new()),
    };
    let title = format!(
        "blocks {}–{}: {} in use, {} cached-free, {} free",
        group[0].id,
        group[group.len() - 1].id,
        count(KvBlockState::InUse),
        count(KvBlockState::CachedFree),
        count(KvBlockState::Free)
    );
    view! { <span class=format!("cell {class}") style=style title=title></span> }
}

fn kv_grid(kv: &KvSummary) -> impl IntoView {
    let all = cells(kv);
    if all.len() > MAX_CELLS {
        let per = all.len().div_ceil(MAX_CELLS);
        return view! {
            <p class="muted">{format!("{per} blocks per cell")}</p>
            {all.chunks(per).map(group_cell).collect_view()}
        }
        .into_any();
    }
    let block_size = kv.block_size;
    all.into_iter()
        .map(|c| {
            let (class, style) = match c.state {
                KvBlockState::Null => ("null", String::new()),
                KvBlockState::Free => ("free", String::new()),
                KvBlockState::CachedFree => ("cached", String::new()),
                KvBlockState::InUse => (
                    if c.owners.len() > 1 { "used shared" } else { "used" },
                    format!("background: {}", colour(c.owners.first().map_or("", |s| s.as_str()))),
                ),
            };
            let hash = c.hash.as_ref().map_or(String::new(), |h| format!(" · hash {h}…"));
            let title = match c.state {
                KvBlockState::Null => format!("block {}: the null block (never holds data)", c.id),
                KvBlockState::Free => format!("block {}: free", c.id),
                KvBlockState::CachedFree => format!(
                    "block {}: free, still in the prefix cache{hash}: a prefix hit can take it back",
                    c.id
                ),
                KvBlockState::InUse => {
                    let i = c.index.unwrap_or(0);
                    format!(
                        "block {}: {} · tokens {}–{} of the sequence{hash}{}",
                        c.id,
                        c.owners.join(", "),
                        i * block_size,
                        (i + 1) * block_size - 1,
                        if c.owners.len() > 1 {
                            " · shared (prefix cache hit)"
                        } else {
                            ""
                        }
                    )
                }
            };
            view! { <span class=format!("cell {class}") style=style title=title></span> }
        })
        .collect_view()
        .into_any()
}

/// The state slots of a hybrid model, one cell per slot: held ones in their request's colour.
fn state_cells(slots: &StateSlots) -> Vec<(String, String)> {
    let held: HashMap<usize, &str> = slots.held_by.iter().map(|(slot, id)| (*slot, id.as_str())).collect();
    (0..slots.total)
        .map(|slot| match held.get(&slot) {
            Some(id) => (
                format!("background: {}", colour(id)),
                format!(
                    "slot {slot}: {id} · {} of conv windows and delta-rule states, the same at any context length",
                    size(slots.bytes_per_slot)
                ),
            ),
            None => (
                String::new(),
                format!("slot {slot}: free · {}", size(slots.bytes_per_slot)),
            ),
        })
        .collect()
}

/// The state cache's heading text, its cells and its note; nothing for models without one.
fn state_view(slots: Option<&StateSlots>) -> impl IntoView {
    slots.map(|slots| {
        let text = format!(
            "{}/{} slots · {} each",
            slots.held_by.len(),
            slots.total,
            size(slots.bytes_per_slot)
        );
        let cells = state_cells(slots)
            .into_iter()
            .map(|(style, title)| {
                let class = if style.is_empty() { "cell free" } else { "cell used" };
                view! { <span class=class style=style title=title></span> }
            })
            .collect_view();
        view! {
            <h3>"State cache " <span data-testid="state-usage">{text}</span></h3>
            <p class="muted">"Gated DeltaNet layers keep one fixed-size state per running request instead of KV that grows with the context."</p>
            <div class="kv-grid" data-testid="state-grid">{cells}</div>
        }
    })
}

/// The memory view of the latest occupancy (a waiting line until the first arrives).
#[component]
pub fn MemoryView(
    /// The latest occupancy.
    occupancy: Signal<Option<Occupancy>>,
    /// The budget the bar is drawn against, when known.
    budget: Signal<Option<Budget>>,
    /// Called when a reset button is pressed.
    on_reset: Callback<ResetKind>,
    /// What the last reset freed, in words.
    reset_result: Signal<Option<String>>,
    /// Image thumbnails (data URLs) by mm hash, for the encoder-cache entries.
    #[prop(optional)]
    thumbnails: Option<Signal<HashMap<String, String>>>,
    /// The areas a lesson step is about (`kv`, `encoder`, `processor`, `ledger`, `counters`).
    #[prop(optional)]
    highlight: Option<Signal<Vec<&'static str>>>,
) -> impl IntoView {
    let lit = move |area: &'static str| highlight.is_some_and(|h| h.with(|h| h.contains(&area)));
    let body = move || {
        let Some(o) = occupancy.get() else {
            return view! { <p class="muted">"No engine yet."</p> }.into_any();
        };
        let budget = budget.get();
        let (segs, total) = segments(&o, budget.as_ref());
        let legend = segs
            .iter()
            .map(|s| view! { <li><span class="swatch" style=format!("background: {}", s.colour)></span>{format!("{} {}", s.label, size(s.bytes))}</li> })
            .collect_view();
        let bar_of = |segs: &[Segment], total: u64| {
            segs.iter()
                .map(|s| {
                    let style = format!(
                        "width: {:.3}%; background: {}",
                        100.0 * s.bytes as f64 / total.max(1) as f64,
                        s.colour
                    );
                    view! { <div style=style title=format!("{} {}", s.label, size(s.bytes))></div> }
                })
                .collect_view()
        };
        let bar = bar_of(&segs, total);
        // The allocations alone, for models too small to show against the budget.
        let held = &segs[..segs.len() - 1];
        let held_total: u64 = held.iter().map(|s| s.bytes).sum();
        let zoom = bar_of(held, held_total);
        let kv = &o.engine.kv;
        let kv_text = format!("{}/{} blocks", kv.num_in_use, kv.num_blocks);
        let kv_detail = format!(
            "{} cached-free, {} free · {} tokens per block · usage {:.1}% · {} evicted from the prefix cache",
            kv.num_cached_free,
            kv.num_free - kv.num_cached_free,
            kv.block_size,
            100.0 * kv.usage,
            kv.num_evictions
        );
        let ec = &o.engine.encoder_cache;
        let n = ec.entries.len();
        let ec_text = format!(
            "{n} {}, {}/{} tokens",
            if n == 1 { "entry" } else { "entries" },
            ec.used_tokens,
            ec.capacity_tokens
        );
        let thumbs = thumbnails.map(|t| t.get()).unwrap_or_default();
        let entries = ec
            .entries
            .iter()
            .map(|e| {
                let thumb = thumbs.get(e.mm_hash.as_str()).cloned();
                let refs = if e.refs.is_empty() {
                    "no request".to_string()
                } else {
                    e.refs.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(", ")
                };
                view! {
                    <li class:freeable=e.freeable>
                        {thumb.map(|src| view! { <img src=src alt="image" /> })}
                        <code>{e.mm_hash.as_str().chars().take(12).collect::<String>()}</code>
                        {format!(" {} tokens · {} · held by {refs}{}", e.num_tokens, size(e.bytes), if e.freeable { " · freeable" } else { "" })}
                    </li>
                }
            })
            .collect_view();
        let pc = &o.processor_cache;
        let pc_text = format!(
            "{} preprocessed {} · {} of {} host memory · {} hits / {} lookups",
            pc.entries.len(),
            if pc.entries.len() == 1 { "image" } else { "images" },
            size(pc.bytes_used),
            size(pc.capacity_bytes),
            pc.stats.hits,
            pc.stats.queries
        );
        let c = &o.engine.counters;
        let prefix = &o.prefix_cache;
        let counters = view! {
            <span>{format!("prefix cache hit rate {:.1}% ({} of {} tokens)", 100.0 * prefix.hit_rate(), prefix.hits, prefix.queries)}</span>
            " · encoder-cache hits " <span data-testid="encoder-cache-hits">{ec.stats.hits}</span>
            {format!(
                " · vision runs {} · preemptions {} · running {} · waiting {}",
                c.vision_runs, c.num_preemptions, o.engine.num_running, o.engine.num_waiting
            )}
        };
        view! {
            <h3 class:lit=lit("ledger")>"Device memory"</h3>
            <div class="bar ledger" data-testid="ledger-bar" title="against the start-up budget">{bar}</div>
            <p class="muted">{format!("allocated: {} (zoomed)", size(held_total))}</p>
            <p class="muted" data-testid="reserved-vs-resident">{resident_line(held_total, &o.process)}</p>
            <div class="bar ledger zoom">{zoom}</div>
            <ul class="legend">{legend}</ul>
            <p class="muted">{budget.map(|b| format!(
                "budget {} of {} ({} for the KV cache)", size(b.requested_bytes), size(b.total_bytes), size(b.kv_cache_bytes)))}</p>
            <h3 class:lit=lit("kv")>"KV cache " <span data-testid="kv-usage">{kv_text}</span></h3>
            <p class="muted">{kv_detail}</p>
            <div class="kv-grid" data-testid="kv-grid">{kv_grid(kv)}</div>
            {state_view(o.engine.states.as_ref())}
            <h3 class:lit=lit("encoder")>"Encoder cache " <span data-testid="encoder-cache-usage">{ec_text}</span></h3>
            <ul class="encoder-entries">{entries}</ul>
            <h3 class:lit=lit("processor")>"Processor cache"</h3>
            <p data-testid="processor-cache-usage">{pc_text}</p>
            <p class="counters" class:lit=lit("counters") data-testid="counters">{counters}</p>
        }
        .into_any()
    };
    view! {
        <section class="memory">
            {body}
            <div class="resets">
                <button data-testid="reset-prefix-cache" on:click=move |_| on_reset.run(ResetKind::Prefix)>"reset prefix cache"</button>
                <button data-testid="reset-encoder-cache" on:click=move |_| on_reset.run(ResetKind::Encoder)>"reset encoder cache"</button>
                <button data-testid="reset-processor-cache" title="what vLLM's /reset_mm_cache resets" on:click=move |_| on_reset.run(ResetKind::Processor)>"reset processor cache (/reset_mm_cache)"</button>
            </div>
            <p class="reset-result" data-testid="reset-result">{move || reset_result.get()}</p>
        </section>
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvlens_engine::cache::RequestId;

    fn summary() -> KvSummary {
        let mut tables = BTreeMap::new();
        tables.insert(RequestId::from("a"), vec![1, 2]);
        tables.insert(RequestId::from("b"), vec![1, 3]);
        KvSummary {
            num_blocks: 6,
            block_size: 16,
            num_free: 2,
            num_cached_free: 1,
            num_in_use: 3,
            usage: 0.6,
            num_evictions: 0,
            runs: vec![
                (KvBlockState::Null, 1),
                (KvBlockState::InUse, 3),
                (KvBlockState::CachedFree, 1),
                (KvBlockState::Free, 1),
            ],
            tables,
            hashes: BTreeMap::from([(1, "00112233445566ff".to_string())]),
        }
    }

    #[test]
    fn state_cells_name_their_holders() {
        let slots = StateSlots {
            total: 3,
            bytes_per_slot: 2 << 20,
            held_by: vec![(2, RequestId::from("b"))],
        };
        let c = state_cells(&slots);
        assert_eq!(c.len(), 3);
        assert!(c[0].0.is_empty() && c[0].1.starts_with("slot 0: free · 2.00 MiB"));
        assert_eq!(c[2].0, format!("background: {}", colour("b")));
        assert!(c[2].1.starts_with("slot 2: b · 2.00 MiB"), "{}", c[2].1);
    }

    #[test]
    fn grid_cells_follow_the_runs_and_name_every_owner() {
        let c = cells(&summary());
        assert_eq!(c.len(), 6);
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5]);
        assert_eq!(c[1].owners, ["a", "b"], "block 1 is shared by both tables");
        assert_eq!(c[3].owners, ["b"]);
        assert_eq!(c[3].index, Some(1), "block 3 is b's second block");
        assert_eq!(c[4].state, KvBlockState::CachedFree);
        assert!(c[5].owners.is_empty());
        assert_eq!(c[1].hash.as_deref(), Some("00112233445566ff"));
        assert_eq!(c[2].hash, None);
    }
}
