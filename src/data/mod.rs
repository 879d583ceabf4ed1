//! Training data: the bundled corpus and tokenizers (`corpus.rs`), token ids
//! in memory or memory-mapped (`tokens.rs`), text and JSONL documents
//! streamed (`documents.rs`), `upipe tokenize`'s parallel batches
//! (`tokenize.rs`), the deterministic sampler of training windows, and
//! `window.rs` a window as the model takes it (`PackedWindow`: inputs,
//! targets, document starts).

pub mod corpus;
pub mod documents;
pub mod tokenize;
pub mod tokens;
pub mod window;

pub use corpus::{
    Batch, ByteTokenizer, CORPUS, SamplerState, SequenceSampler, Tokenizer, Window, check_vocab,
    load_tokens, write_u32_tokens,
};
pub use tokens::{TokenFormat, Tokens};
pub use window::PackedWindow;
