// A GGUF pair loaded by URL in the playground (headless Chromium, Playwright): how long the
// verdict, the load and a first reply take, what the tab holds and the reply's token ids, for
// docs/PERFORMANCE-HISTORY.md's "pair in a tab" table. Not a test: a large pair takes minutes.
//
//   NODE_PATH=~/.cache/kvlens/tools/node_modules node tools/gguf/playground_pair.cjs \
//     http://127.0.0.1:8000 webgpu|cpu MODEL_URL [MMPROJ_URL]
//
// BASE serves the playground (`kvlens serve --playground-dir SITE`, which answers range
// requests). Settings from the environment: CTX (context, 1024), BLOCKS (KV blocks, 64),
// MNBT (tokens per step, 256), IMG (largest image, tokens, 64); IMAGE (a file) adds an image turn.
const { chromium } = require('playwright-core');

const [base, backend, model, mmproj] = process.argv.slice(2);
const env = (name, fallback) => process.env[name] || fallback;

(async () => {
  const args = ['--headless=new', '--no-sandbox', '--disable-dev-shm-usage'];
  args.push(...(backend === 'webgpu' ? ['--enable-unsafe-webgpu', '--enable-webgpu-developer-features'] : ['--disable-webgpu']));
  const browser = await chromium.launch({ executablePath: env('CHROMIUM', '/usr/bin/chromium'), args });
  const page = await browser.newPage();
  const byTest = (id) => page.locator(`[data-testid="${id}"]`);
  const set = async (id, value) => {
    await byTest(id).fill(String(value));
    await byTest(id).dispatchEvent('change');
  };
  const since = (t) => `${((Date.now() - t) / 1000).toFixed(1)} s`;
  const replyDone = (n) => page.waitForFunction(
    (n) => document.querySelectorAll('[data-testid="assistant-message"]')[n]?.dataset.done === 'true',
    n,
    { timeout: 3600e3 },
  );
  try {
    await page.goto(`${base}/`);
    await page.waitForFunction(() => !(document.querySelector('[data-testid="device"]')?.textContent ?? 'looking').includes('looking'), null, { timeout: 120e3 });
    console.log('device:', (await byTest('device').textContent()).slice(0, 100));
    await byTest('checkpoint-url').fill(model);
    if (mmproj) await byTest('checkpoint-mmproj-url').fill(mmproj);
    await set('max-model-len', env('CTX', 1024));
    await set('kv-blocks', env('BLOCKS', 64));
    await set('max-num-batched-tokens', env('MNBT', 256));
    await set('max-image-tokens', env('IMG', 64));
    const started = Date.now();
    await byTest('load-url').click();
    await page.waitForFunction(() => (document.querySelector('[data-testid="verdict"]')?.textContent || '').length > 0, null, { timeout: 300e3 });
    console.log(`verdict after ${since(started)}:`, await byTest('verdict').textContent());
    await page.waitForFunction(() => /ready|not loaded/.test(document.querySelector('[data-testid="model-status"]')?.textContent || ''), null, { timeout: 3600e3 });
    console.log(`status after ${since(started)}:`, (await byTest('model-status').textContent()).slice(0, 200));
    console.log('held:', await page.locator('.local .legend li').allTextContents());
    await set('max-tokens', 3);
    await byTest('chat-input').fill('Describe a cat.');
    let asked = Date.now();
    await byTest('send').click();
    await replyDone(0);
    const first = byTest('assistant-message').first();
    console.log(`reply after ${since(asked)}: ids ${await first.getAttribute('data-token-ids')} | ${await first.textContent()}`);
    if (process.env.IMAGE) {
      await byTest('image-input').setInputFiles(process.env.IMAGE);
      await page.waitForSelector('.pending img', { timeout: 60e3 });
      await byTest('chat-input').fill('Describe this image.');
      asked = Date.now();
      await byTest('send').click();
      await replyDone(1);
      console.log(`image reply after ${since(asked)}: ids ${await byTest('assistant-message').nth(1).getAttribute('data-token-ids')}`);
      console.log('held:', await page.locator('.local .legend li').allTextContents());
    }
  } finally {
    await browser.close();
  }
})().catch((e) => {
  console.log('FAILED', e.message.slice(0, 500));
  process.exit(1);
});
