//! Training data: the bundled corpus and tokenizers (`corpus.rs`), token ids
//! in memory or memory-mapped (`tokens.rs`), the document index and loss
//! mask files beside them (`doc_index.rs`) and the three read together
//! (`dataset.rs`), text, JSONL and Parquet documents streamed (`documents.rs`,
//! `inputs.rs`, `parquet_input.rs`, chat templates `chat.rs`) within the
//! bounds of `limits.rs`,
//! `upipe tokenize`'s parallel batches (`tokenize.rs`), `--pack`'s windows
//! (`packing.rs`) and the sampler that draws them (`sampler.rs`), a
//! weighted mixture of corpora (`mixture.rs`), and
//! `window.rs` a window as the model takes it (`PackedWindow`: inputs,
//! targets, document starts), and `retrieval/` the synthetic retrieval
//! trials of `upipe eval --task` (needles, haystacks, templates).

pub mod chat;
pub mod corpus;
pub mod dataset;
pub mod doc_index;
pub mod documents;
pub mod inputs;
pub mod limits;
pub mod mixture;
pub mod packing;
pub mod parquet_input;
pub mod retrieval;
pub mod sampler;
pub mod tokenize;
pub mod tokens;
pub mod window;

pub use corpus::{
    Batch, ByteTokenizer, CORPUS, SamplerState, SequenceSampler, Tokenizer, Window, check_vocab,
    load_tokens, write_u32_tokens,
};
pub use dataset::Dataset;
pub use mixture::{Mixture, MixtureSampler};
pub use packing::PackMode;
pub use sampler::PackedSampler;
pub use tokens::{TokenFormat, Tokens};
pub use window::PackedWindow;
