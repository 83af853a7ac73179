//! Where the playground's checkpoint comes from: a base URL (the bundled demo model, a local static
//! server, a Hugging Face `resolve/main/` URL) or files picked from disk. Small files are read
//! whole; weight files are handed over chunk by chunk, so a checkpoint is never held whole in wasm
//! memory. What was fetched is kept in Cache Storage, so a reload does not download it again.

use js_sys::{Reflect, Uint8Array};
use kvlens_engine::arch::config::ModelConfig;
use kvlens_engine::input::chat::select_chat_template;
use kvlens_engine::model::checkpoint_files;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_sys::{Blob, Cache, File, ReadableStreamDefaultReader, Response};

/// The Cache Storage bucket fetched checkpoint files are kept in.
const CACHE_NAME: &str = "kvlens-checkpoints";

/// Bytes read from a picked file at a time.
const FILE_CHUNK: f64 = 4.0 * 1024.0 * 1024.0;

/// Where the files are.
#[derive(Clone, Debug)]
pub enum Source {
    /// A directory URL ending in `/`.
    Url(String),
    /// Files picked from disk (a folder or several files), found by name.
    Files(Vec<File>),
}

/// The small files of a checkpoint, read before any weight.
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    /// config.json, parsed.
    pub config: ModelConfig,
    /// tokenizer.json.
    pub tokenizer_json: Vec<u8>,
    /// The chat template (chat_template.jinja, chat_template.json or tokenizer_config.json).
    pub chat_template: String,
    /// preprocessor_config.json, when present.
    pub preprocessor_json: Option<String>,
    /// End-of-sequence ids (generation_config.json's, else the config's).
    pub eos: Vec<u32>,
    /// Weight files in load order, with their sizes when known before reading (picked files).
    pub shards: Vec<(String, Option<u64>)>,
}

fn js_error(what: &str, e: JsValue) -> String {
    let text = e
        .dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| e.as_string())
        .unwrap_or_else(|| format!("{e:?}"));
    format!("{what}: {text}")
}

/// The response for `url`, from Cache Storage when it holds it, else fetched (and stored there
/// while it is read; a cache that refuses, e.g. over quota, only costs the next reload).
async fn fetch_cached(url: &str) -> Result<Option<Response>, String> {
    // Loading runs in the engine's worker.
    let scope: web_sys::WorkerGlobalScope = js_sys::global()
        .dyn_into()
        .map_err(|_| "checkpoints are fetched in the engine's worker")?;
    let cache: Option<Cache> = match scope.caches() {
        Ok(storage) => JsFuture::from(storage.open(CACHE_NAME))
            .await
            .ok()
            .map(|c| c.unchecked_into()),
        Err(_) => None,
    };
    if let Some(cache) = &cache {
        if let Ok(hit) = JsFuture::from(cache.match_with_str(url)).await {
            if let Ok(response) = hit.dyn_into::<Response>() {
                return Ok(Some(response));
            }
        }
    }
    let response: Response = JsFuture::from(scope.fetch_with_str(url))
        .await
        .map_err(|e| js_error(&format!("fetching {url}"), e))?
        .unchecked_into();
    match response.status() {
        200 => {}
        404 => return Ok(None),
        s => return Err(format!("fetching {url}: HTTP {s}")),
    }
    if let (Some(cache), Ok(copy)) = (cache, response.clone()) {
        let put = cache.put_with_str(url, &copy);
        wasm_bindgen_futures::spawn_local(async move {
            if let Err(e) = JsFuture::from(put).await {
                web_sys::console::warn_1(&JsValue::from_str(&js_error("not kept in Cache Storage", e)));
            }
        });
    }
    Ok(Some(response))
}

impl Source {
    fn url(base: &str, name: &str) -> String {
        format!("{}/{name}", base.trim_end_matches('/'))
    }

    fn file(&self, name: &str) -> Option<File> {
        match self {
            Source::Files(files) => files.iter().find(|f| f.name() == name).cloned(),
            Source::Url(_) => None,
        }
    }

    /// A whole small file; None when the checkpoint has no such file.
    pub async fn bytes(&self, name: &str) -> Result<Option<Vec<u8>>, String> {
        let buffer = match self {
            Source::Url(base) => match fetch_cached(&Self::url(base, name)).await? {
                Some(r) => r.array_buffer().map_err(|e| js_error(name, e))?,
                None => return Ok(None),
            },
            Source::Files(_) => match self.file(name) {
                Some(f) => f.array_buffer(),
                None => return Ok(None),
            },
        };
        let buffer = JsFuture::from(buffer).await.map_err(|e| js_error(name, e))?;
        Ok(Some(Uint8Array::new(&buffer).to_vec()))
    }

    /// A whole small text file; None when the checkpoint has no such file.
    pub async fn text(&self, name: &str) -> Result<Option<String>, String> {
        match self.bytes(name).await? {
            Some(b) => String::from_utf8(b)
                .map(Some)
                .map_err(|_| format!("{name} is not UTF-8")),
            None => Ok(None),
        }
    }

    /// The size of a picked file (a URL's is known once its response starts).
    fn size(&self, name: &str) -> Option<u64> {
        self.file(name).map(|f| f.size() as u64)
    }

    /// Reads the small files and names the weight files.
    pub async fn info(&self) -> Result<CheckpointInfo, String> {
        let config_text = self
            .text("config.json")
            .await?
            .ok_or("the checkpoint has no config.json")?;
        let config = ModelConfig::from_json(&config_text).map_err(|e| format!("config.json: {e}"))?;
        let tokenizer_json = self
            .bytes("tokenizer.json")
            .await?
            .ok_or("the checkpoint has no tokenizer.json")?;
        let jinja = self.text("chat_template.jinja").await?;
        let json = match jinja {
            Some(_) => None,
            None => self.text("chat_template.json").await?,
        };
        let tokenizer_config = match (&jinja, &json) {
            (None, None) => self.text("tokenizer_config.json").await?,
            _ => None,
        };
        let chat_template = select_chat_template(jinja.as_deref(), json.as_deref(), tokenizer_config.as_deref())
            .map_err(|e| e.to_string())?
            .ok_or("the checkpoint has no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json)")?;
        let generation = self.text("generation_config.json").await?;
        let eos = checkpoint_files::eos_token_ids(&config, generation.as_deref())
            .map_err(|e| format!("generation_config.json: {e}"))?;
        let names = match self.text("model.safetensors.index.json").await? {
            Some(index) => {
                checkpoint_files::shard_names(&index).map_err(|e| format!("model.safetensors.index.json: {e}"))?
            }
            None => vec!["model.safetensors".to_string()],
        };
        let shards = names
            .into_iter()
            .map(|name| {
                let size = self.size(&name);
                (name, size)
            })
            .collect();
        Ok(CheckpointInfo {
            config,
            tokenizer_json,
            chat_template,
            preprocessor_json: self.text("preprocessor_config.json").await?,
            eos,
            shards,
        })
    }

    /// Hands the file `name` to `each` chunk by chunk, in order, after telling `length` its size
    /// when the source knows it.
    pub async fn stream(
        &self,
        name: &str,
        length: impl FnOnce(Option<u64>),
        mut each: impl FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        match self {
            Source::Files(_) => {
                let file = self.file(name).ok_or_else(|| format!("{name} was not picked"))?;
                let blob: &Blob = file.as_ref();
                let size = file.size();
                length(Some(size as u64));
                let mut at = 0.0;
                while at < size {
                    let end = (at + FILE_CHUNK).min(size);
                    let part = blob.slice_with_f64_and_f64(at, end).map_err(|e| js_error(name, e))?;
                    let buffer = JsFuture::from(part.array_buffer())
                        .await
                        .map_err(|e| js_error(name, e))?;
                    each(&Uint8Array::new(&buffer).to_vec())?;
                    at = end;
                }
                Ok(())
            }
            Source::Url(base) => {
                let response = fetch_cached(&Self::url(base, name))
                    .await?
                    .ok_or_else(|| format!("{name} is missing"))?;
                length(
                    response
                        .headers()
                        .get("content-length")
                        .ok()
                        .flatten()
                        .and_then(|l| l.parse().ok()),
                );
                let body = response.body().ok_or_else(|| format!("{name}: empty response"))?;
                let reader: ReadableStreamDefaultReader = body.get_reader().unchecked_into();
                loop {
                    let chunk = JsFuture::from(reader.read()).await.map_err(|e| js_error(name, e))?;
                    let done = Reflect::get(&chunk, &"done".into()).ok().and_then(|d| d.as_bool());
                    if done != Some(false) {
                        return Ok(());
                    }
                    let value = Reflect::get(&chunk, &"value".into()).map_err(|e| js_error(name, e))?;
                    each(&Uint8Array::new(&value).to_vec())?;
                }
            }
        }
    }
}
