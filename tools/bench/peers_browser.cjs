// Benchmark: the playground's engine against wllama (llama.cpp compiled to wasm) in one headless
// Chromium, on the same GGUF text model and prompt (`cargo xtask bench peers-browser`, which
// builds the playground and installs wllama, then runs this). Not a test: a 2B model takes minutes.
//
//   NODE_PATH=~/.cache/kvlens/tools/node_modules node tools/bench/peers_browser.cjs \
//     --site dist --wllama DIR/node_modules/@wllama/wllama/esm --model FILE.gguf [--out OUT.json]
//
// One static server answers everything with the cross-origin-isolation headers wllama's threads
// need (COOP same-origin, COEP require-corp) and with range requests (our loader reads the file
// in ranges). Each engine runs in a fresh browser with WebGPU off, so both are wasm on the CPU:
//   - kvlens, at 1 thread and at `--threads` (`kvlens-n`: the page's `?threads=N`, helper workers
//     computing shares of the products' rows): the playground's CPU fallback, the model loaded by
//     URL, one chat turn; prefill and decode rates from the reply's stats line.
//   - wllama, at 1 thread (like for like) and at `--threads` (its default, all cores): the same
//     file by URL, the same chat prompt (the model's own template), greedy; llama.cpp's timings.
//   - kvlens on the page's WebGPU (`kvlens-webgpu`, in a browser with WebGPU on): without a GPU
//     that is SwiftShader, a correctness run of `--webgpu-tokens` tokens, not a speed figure.
// Load time is from the click (or call) to ready; peak memory is the largest Chromium process's
// RSS among this script's descendants, sampled every 200 ms while the engine loads and answers, and
// taken again once the reply is done.
const fs = require('fs');
const http = require('http');
const path = require('path');
const { execFileSync } = require('child_process');
const { chromium } = require('playwright-core');

const argv = process.argv.slice(2);
// kvlens's CPU fallback and wllama, each at one thread and at `--threads`; kvlens on the page's WebGPU.
const ENGINES = ['kvlens', 'kvlens-n', 'wllama-1', 'wllama-n', 'kvlens-webgpu'];
const KNOWN = ['site', 'wllama', 'model', 'out', 'threads', 'tokens', 'prompt', 'engines', 'max-num-batched-tokens',
  'webgpu-tokens', 'webgpu-max-num-batched-tokens'];
for (let i = 0; i < argv.length; i += 2) {
  const name = argv[i].replace(/^--/, '');
  if (!argv[i].startsWith('--') || !KNOWN.includes(name)) usage(`unknown argument ${argv[i]}`);
  if (i + 1 >= argv.length) usage(`${argv[i]} needs a value`);
}
// The last occurrence wins (the xtask passes its defaults first).
const opt = (name, fallback) => {
  const i = argv.lastIndexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : fallback;
};
const required = (name) => opt(name) ?? usage(`--${name} is required`);
const number = (name, fallback) => {
  const n = Number(opt(name, fallback));
  return Number.isFinite(n) && n > 0 ? n : usage(`--${name} must be a positive number`);
};
function usage(why) {
  console.error(`${why}\nusage: peers_browser.cjs --wllama DIR --model FILE.gguf [--site dist] [--out OUT.json] [--threads N] [--tokens N] [--prompt TEXT] [--engines ${ENGINES.join(',')}] [--max-num-batched-tokens N] [--webgpu-tokens N] [--webgpu-max-num-batched-tokens N]`);
  process.exit(2);
}
const site = path.resolve(opt('site', 'dist'));
const wllamaDir = path.resolve(required('wllama'));
const model = path.resolve(required('model'));
const out = opt('out');
const threads = number('threads', require('os').cpus().length);
const tokens = number('tokens', 32);
const prompt = opt('prompt', 'Write a long story about a lighthouse keeper.');
const engines = opt('engines', ENGINES.join(',')).split(',');
for (const e of engines) if (!ENGINES.includes(e)) usage(`unknown engine ${e}`);
// The tab's tokens per step (`--max-num-batched-tokens`): start-up profiles a batch this large.
const mnbt = number('max-num-batched-tokens', 64);
// Our WebGPU path: on a machine without a GPU, Chromium's SwiftShader, a correctness run (seconds
// per token), so it takes fewer tokens and a smaller profile batch.
const webgpuTokens = number('webgpu-tokens', 4);
const webgpuMnbt = number('webgpu-max-num-batched-tokens', 16);
const chromiumPath = process.env.CHROMIUM || '/usr/bin/chromium';

const types = { '.html': 'text/html', '.js': 'text/javascript', '.mjs': 'text/javascript', '.wasm': 'application/wasm', '.css': 'text/css', '.json': 'application/json' };

/** The page that drives wllama; `window.runWllama` returns its timings. */
const wllamaPage = `<!doctype html><meta charset="utf-8"><title>wllama</title>
<script type="module">
import { Wllama } from '/wllama/index.js';
window.runWllama = async (url, nThreads, prompt, maxTokens) => {
  const w = new Wllama({ default: '/wllama/wasm/wllama.wasm' }, { suppressNativeLog: true });
  const t0 = performance.now();
  await w.loadModelFromUrl(url, { n_threads: nThreads, n_ctx: 1024, n_gpu_layers: 0, useCache: false });
  const load_s = (performance.now() - t0) / 1e3;
  let timings = null, text = '';
  const t1 = performance.now();
  await w.createChatCompletion({
    messages: [{ role: 'user', content: prompt }], max_tokens: maxTokens, temperature: 0, top_k: 1,
    ignore_eos: true, stream: true,
    onData: (chunk) => { timings = chunk.timings || timings; text += chunk.choices?.[0]?.delta?.content || ''; },
  });
  const reply_s = (performance.now() - t1) / 1e3;
  return { load_s, reply_s, timings, text, multithread: w.isMultithread(), threads: w.getNumThreads(),
    version: Wllama.getLibllamaVersion ? Wllama.getLibllamaVersion() : null };
};
window.wllamaReady = true;
</script>`;

/** Serves `site` at /, wllama's esm at /wllama/, the model at /model.gguf. */
function serve() {
  const server = http.createServer((req, res) => {
    const url = new URL(req.url, 'http://x');
    let file;
    url.pathname = decodeURIComponent(url.pathname);
    if (url.pathname === '/wllama.html') {
      res.writeHead(200, headers('text/html', Buffer.byteLength(wllamaPage)));
      return res.end(wllamaPage);
    } else if (url.pathname === '/model.gguf') file = model;
    else if (url.pathname.startsWith('/wllama/')) file = path.join(wllamaDir, url.pathname.slice(8));
    else file = path.join(site, url.pathname === '/' ? 'index.html' : url.pathname);
    let stat;
    try {
      stat = fs.statSync(file);
      if (!stat.isFile()) throw new Error('not a file');
    } catch {
      res.writeHead(404, headers('text/plain', 9));
      return res.end('not found');
    }
    const type = types[path.extname(file)] || 'application/octet-stream';
    const range = /^bytes=(\d+)-(\d*)$/.exec(req.headers.range || '');
    const send = (options) => fs.createReadStream(file, options).on('error', () => res.destroy()).pipe(res);
    if (range) {
      const start = Number(range[1]);
      const end = Math.min(range[2] ? Number(range[2]) : stat.size - 1, stat.size - 1);
      if (start >= stat.size || end < start) {
        res.writeHead(416, { ...headers('text/plain', 0), 'Content-Range': `bytes */${stat.size}` });
        return res.end();
      }
      res.writeHead(206, { ...headers(type, end - start + 1), 'Content-Range': `bytes ${start}-${end}/${stat.size}` });
      if (req.method === 'HEAD') return res.end();
      return send({ start, end });
    }
    res.writeHead(200, headers(type, stat.size));
    if (req.method === 'HEAD') return res.end();
    send({});
  });
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(server)));
}

function headers(type, length) {
  return {
    'Content-Type': type,
    'Content-Length': length,
    'Accept-Ranges': 'bytes',
    'Cross-Origin-Opener-Policy': 'same-origin',
    'Cross-Origin-Embedder-Policy': 'require-corp',
    'Cross-Origin-Resource-Policy': 'same-origin',
    'Cache-Control': 'no-store',
  };
}

/** The largest RSS (bytes) among the process `root` and its descendants now. */
function largestRss(root) {
  const procs = new Map();
  for (const pid of fs.readdirSync('/proc').filter((d) => /^\d+$/.test(d))) {
    try {
      const status = fs.readFileSync(`/proc/${pid}/status`, 'utf8');
      const ppid = Number(/^PPid:\s*(\d+)/m.exec(status)?.[1]);
      const rss = Number(/^VmRSS:\s*(\d+) kB/m.exec(status)?.[1] ?? 0) * 1024;
      procs.set(Number(pid), { ppid, rss });
    } catch {}
  }
  const inTree = (pid) => {
    for (let p = pid, hops = 0; p > 1 && hops < 64; p = procs.get(p)?.ppid ?? 0, hops++) if (p === root) return true;
    return false;
  };
  let largest = 0;
  for (const [pid, { rss }] of procs) if (inTree(pid)) largest = Math.max(largest, rss);
  return largest;
}

/** Runs `f(page)` in a fresh browser, sampling the peak RSS meanwhile and taking it at the end. */
async function inBrowser(f, webgpu = false) {
  const gpu = webgpu ? ['--enable-unsafe-webgpu', '--enable-webgpu-developer-features'] : ['--disable-webgpu'];
  const browser = await chromium.launch({
    executablePath: chromiumPath,
    args: ['--headless=new', '--no-sandbox', '--disable-dev-shm-usage', ...gpu],
  });
  let peak = 0;
  // Playwright starts Chromium as a child of this process: its tree is ours alone.
  const sampler = setInterval(() => { peak = Math.max(peak, largestRss(process.pid)); }, 200);
  try {
    const page = await browser.newPage();
    // Warnings (Cache Storage refusing a copy) and errors in the page, but not the browser's own
    // request for a favicon none of the pages has.
    page.on('console', (m) => {
      if (m.type() === 'warning' && !/integrity. attribute/.test(m.text())) console.log('  page warning:', m.text().slice(0, 300));
      if (m.type() === 'error' && !/404 \(Not Found\)/.test(m.text())) console.log('  page error:', m.text().slice(0, 300));
    });
    const result = await f(page);
    // What stays once the reply is done: the peak less this is what the load or the reply held
    // only for a while.
    const end = largestRss(process.pid);
    return { ...result, peak_rss_gib: Math.max(peak, end) / 2 ** 30, end_rss_gib: end / 2 ** 30 };
  } finally {
    clearInterval(sampler);
    await browser.close();
  }
}

async function runKvlens(base, webgpu, nThreads = 1) {
  const [steps, newTokens] = webgpu ? [webgpuMnbt, webgpuTokens] : [mnbt, tokens];
  return inBrowser(async (page) => {
    const byTest = (id) => page.locator(`[data-testid="${id}"]`);
    const set = async (id, value) => {
      await byTest(id).fill(String(value));
      await byTest(id).dispatchEvent('change');
    };
    await page.goto(`${base}/?threads=${nThreads}`);
    await page.waitForFunction(() => !(document.querySelector('[data-testid="device"]')?.textContent ?? 'looking').includes('looking'), null, { timeout: 120e3 });
    const device = (await byTest('device').textContent()).slice(0, 160);
    if (!webgpu && nThreads > 1 && !device.includes(`${nThreads} threads`)) throw new Error(`asked for ${nThreads} threads: ${device}`);
    await byTest('checkpoint-url').fill(`${base}/model.gguf`);
    await set('max-model-len', 1024);
    await set('kv-blocks', 64);
    await set('max-num-batched-tokens', steps);
    const started = Date.now();
    await byTest('load-url').click();
    // The load's phases, as the status line names them, with the time each began.
    const phases = [];
    let status = '';
    for (;;) {
      status = (await byTest('model-status').textContent()) || '';
      // The weights read (the progress bar full) and the start-up profile after it.
      const read = await page.evaluate(() => document.querySelector('[data-testid="load-progress"] progress')?.value === 1);
      const phase = `${status.slice(0, 80)}${read ? ' (all weights read)' : ''}`;
      if (!phases.length || phases[phases.length - 1][1] !== phase) phases.push([(Date.now() - started) / 1e3, phase]);
      if (/ready|not loaded/.test(status)) break;
      if (Date.now() - started > 3600e3) throw new Error(`kvlens still loading after an hour: ${status}`);
      await page.waitForTimeout(250);
    }
    for (const [t, phase] of phases) console.log(`  ${t.toFixed(1)} s: ${phase}`);
    if (!/ready/.test(status)) throw new Error(`kvlens did not load: ${status.slice(0, 300)}`);
    const load_s = (Date.now() - started) / 1e3;
    // The memory view's ledger total and the engine's wasm memory (which never shrinks).
    const memory = async () => {
      const line = (await byTest('reserved-vs-resident').textContent()) || '';
      const mib = (re) => Number(re.exec(line)?.[1] ?? NaN) / 1024;
      return { ledger_gib: mib(/reserved \(ledger\): ([\d.]+) MiB/), wasm_gib: mib(/wasm memory: ([\d.]+) MiB/) };
    };
    const loaded = await memory();
    await set('max-tokens', newTokens);
    await byTest('chat-input').fill(prompt);
    const asked = Date.now();
    await byTest('send').click();
    await page.waitForFunction(() => document.querySelectorAll('[data-testid="assistant-message"]')[0]?.dataset.done === 'true', null, { timeout: 3600e3 });
    const reply_s = (Date.now() - asked) / 1e3;
    const reply = byTest('assistant-message').first();
    const stats = await reply.locator('.stats').textContent();
    const m = /prefill (\d+) tokens at ([\d.]+) tok\/s · decode (\d+) tokens at ([\d.]+) tok\/s/.exec(stats);
    if (!m) throw new Error(`no rates in the reply's stats: ${stats}`);
    const answered = await memory();
    return {
      ledger_gib: answered.ledger_gib, wasm_loaded_gib: loaded.wasm_gib, wasm_end_gib: answered.wasm_gib,
      engine: webgpu ? `kvlens (WebGPU: ${/swiftshader/i.test(device) ? 'SwiftShader, a correctness run' : 'the adapter'})` : `kvlens (wasm CPU, ${nThreads} thread${nThreads > 1 ? 's' : ''})`,
      threads: webgpu ? null : nThreads, status, device, max_num_batched_tokens: steps, load_s, phases, reply_s, stats,
      prompt_tokens: Number(m[1]), prefill_tok_s: Number(m[2]), decode_tokens: Number(m[3]), decode_tok_s: Number(m[4]),
      token_ids: (await reply.getAttribute('data-token-ids')).split(',').map(Number),
    };
  }, webgpu);
}

async function runWllama(base, nThreads) {
  return inBrowser(async (page) => {
    await page.goto(`${base}/wllama.html`);
    await page.waitForFunction(() => window.wllamaReady === true && self.crossOriginIsolated, null, { timeout: 60e3 });
    const r = await page.evaluate(([url, n, p, t]) => window.runWllama(url, n, p, t), [`${base}/model.gguf`, nThreads, prompt, tokens]);
    const t = r.timings || {};
    return {
      engine: `wllama (wasm CPU, ${r.threads} thread${r.threads > 1 ? 's' : ''}${r.multithread ? ', multi-thread build' : ''})`,
      threads: r.threads, load_s: r.load_s, reply_s: r.reply_s, version: r.version,
      prompt_tokens: t.prompt_n, prefill_tok_s: t.prompt_per_second, decode_tokens: t.predicted_n, decode_tok_s: t.predicted_per_second,
      text: r.text.slice(0, 200),
    };
  });
}

(async () => {
  const server = await serve();
  const base = `http://127.0.0.1:${server.address().port}`;
  const wllamaVersion = JSON.parse(fs.readFileSync(path.join(wllamaDir, '..', 'package.json'), 'utf8')).version;
  const chromiumVersion = execFileSync(chromiumPath, ['--version']).toString().trim();
  const rows = [];
  try {
    for (const engine of engines) {
      console.log(`${engine} …`);
      try {
        const row = engine.startsWith('kvlens') ? await runKvlens(base, engine === 'kvlens-webgpu', engine === 'kvlens-n' ? threads : 1)
          : await runWllama(base, engine === 'wllama-1' ? 1 : threads);
        console.log(' ', JSON.stringify(row));
        rows.push(row);
      } catch (e) {
        // One engine's failure is a row of the report, not the end of the others' runs.
        console.log(`  ${engine} FAILED: ${e.message.slice(0, 500)}`);
        rows.push({ engine, failed: e.message.slice(0, 2000) });
      }
    }
  } finally {
    server.close();
  }
  // Like for like: kvlens's wasm row at the same threads.
  const kvAt = (n) => rows.find((r) => !r.failed && r.engine.startsWith('kvlens (wasm') && r.threads === n);
  console.log(`\n${path.basename(model)}, ${chromiumVersion}, wllama ${wllamaVersion}, ${tokens} new tokens (${webgpuTokens} on WebGPU)`);
  console.log('| engine | load s | prefill tok/s (prompt tokens) | decode tok/s | kvlens decode (same threads) ÷ this | peak RSS GiB | RSS at the end GiB |');
  console.log('|---|---|---|---|---|---|---|');
  for (const r of rows.filter((r) => !r.failed)) {
    const kv = kvAt(r.threads);
    const ratio = kv && !r.engine.startsWith('kvlens') ? `${(kv.decode_tok_s / r.decode_tok_s).toFixed(2)}×` : '';
    console.log(`| ${r.engine} | ${r.load_s.toFixed(1)} | ${r.prefill_tok_s?.toFixed(2)} (${r.prompt_tokens}) | ${r.decode_tok_s?.toFixed(2)} | ${ratio} | ${r.peak_rss_gib.toFixed(2)} | ${r.end_rss_gib.toFixed(2)} |`);
  }
  for (const r of rows.filter((r) => !r.failed && r.wasm_end_gib)) {
    console.log(`${r.engine}: ledger ${r.ledger_gib.toFixed(2)} GiB; the engine's wasm memory ${r.wasm_loaded_gib.toFixed(2)} GiB once loaded, ${r.wasm_end_gib.toFixed(2)} at the end`);
  }
  if (out) {
    fs.writeFileSync(out, JSON.stringify({
      date: new Date().toISOString().slice(0, 10), model: path.basename(model), cpu: cpuModel(), threads,
      chromium: chromiumVersion, wllama: wllamaVersion, tokens, prompt, rows,
    }, null, 2));
  }
  if (rows.some((r) => r.failed)) process.exit(1);
})().catch((e) => {
  console.log('FAILED', e.stack?.slice(0, 1500) || e);
  process.exit(1);
});

function cpuModel() {
  const line = fs.readFileSync('/proc/cpuinfo', 'utf8').split('\n').find((l) => l.startsWith('model name'));
  return line ? line.split(':')[1].trim() : 'unknown';
}
