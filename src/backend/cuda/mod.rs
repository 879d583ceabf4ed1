pub mod flash;
